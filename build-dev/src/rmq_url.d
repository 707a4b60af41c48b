build-dev/src/rmq_url.o: src/rmq_url.c src/rmq.h include/idem/error.h \
 src/envelope.h
src/rmq.h:
include/idem/error.h:
src/envelope.h:
