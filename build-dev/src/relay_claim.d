build-dev/src/relay_claim.o: src/relay_claim.c include/idem/log.h \
 src/clock.h src/relay_int.h include/idem/relay.h include/idem/error.h \
 src/metrics.h src/envelope.h src/pg.h src/rmq.h
include/idem/log.h:
src/clock.h:
src/relay_int.h:
include/idem/relay.h:
include/idem/error.h:
src/metrics.h:
src/envelope.h:
src/pg.h:
src/rmq.h:
