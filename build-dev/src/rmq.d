build-dev/src/rmq.o: src/rmq.c include/idem/log.h src/clock.h \
 src/rmq_int.h src/backoff.h src/rmq.h include/idem/error.h \
 src/envelope.h
include/idem/log.h:
src/clock.h:
src/rmq_int.h:
src/backoff.h:
src/rmq.h:
include/idem/error.h:
src/envelope.h:
