build-dev/src/consumer_tx.o: src/consumer_tx.c include/idem/log.h \
 src/backoff.h src/clock.h src/consumer_int.h include/idem/consumer.h \
 include/idem/error.h include/idem/handler.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h src/envelope.h src/metrics.h \
 src/pg.h src/registry.h src/rmq.h src/event.h src/fault.h src/mask.h \
 src/policy.h
include/idem/log.h:
src/backoff.h:
src/clock.h:
src/consumer_int.h:
include/idem/consumer.h:
include/idem/error.h:
include/idem/handler.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
src/envelope.h:
src/metrics.h:
src/pg.h:
src/registry.h:
src/rmq.h:
src/event.h:
src/fault.h:
src/mask.h:
src/policy.h:
