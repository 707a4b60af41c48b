build-dev/src/rmq_publish.o: src/rmq_publish.c src/rmq_int.h \
 src/backoff.h src/rmq.h include/idem/error.h src/envelope.h
src/rmq_int.h:
src/backoff.h:
src/rmq.h:
include/idem/error.h:
src/envelope.h:
