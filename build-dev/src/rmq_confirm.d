build-dev/src/rmq_confirm.o: src/rmq_confirm.c src/clock.h src/rmq_int.h \
 src/backoff.h src/rmq.h include/idem/error.h src/envelope.h
src/clock.h:
src/rmq_int.h:
src/backoff.h:
src/rmq.h:
include/idem/error.h:
src/envelope.h:
