build-dev/src/relay_batch.o: src/relay_batch.c include/idem/log.h \
 src/clock.h src/fault.h src/relay_int.h include/idem/relay.h \
 include/idem/error.h src/metrics.h src/envelope.h src/pg.h src/rmq.h
include/idem/log.h:
src/clock.h:
src/fault.h:
src/relay_int.h:
include/idem/relay.h:
include/idem/error.h:
src/metrics.h:
src/envelope.h:
src/pg.h:
src/rmq.h:
