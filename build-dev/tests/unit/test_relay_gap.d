build-dev/tests/unit/test_relay_gap: tests/unit/test_relay_gap.c \
 src/relay_int.h include/idem/relay.h include/idem/error.h src/metrics.h \
 src/envelope.h src/pg.h src/rmq.h
src/relay_int.h:
include/idem/relay.h:
include/idem/error.h:
src/metrics.h:
src/envelope.h:
src/pg.h:
src/rmq.h:
