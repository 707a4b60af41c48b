build-dev/src/metrics_http.o: src/metrics_http.c src/clock.h \
 src/metrics_http.h include/idem/error.h
src/clock.h:
src/metrics_http.h:
include/idem/error.h:
