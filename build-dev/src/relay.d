build-dev/src/relay.o: src/relay.c include/idem/log.h src/backoff.h \
 src/clock.h src/relay_int.h include/idem/relay.h include/idem/error.h \
 src/metrics.h src/envelope.h src/pg.h src/rmq.h
include/idem/log.h:
src/backoff.h:
src/clock.h:
src/relay_int.h:
include/idem/relay.h:
include/idem/error.h:
src/metrics.h:
src/envelope.h:
src/pg.h:
src/rmq.h:
