build-dev/tests/unit/test_consumer_window: \
 tests/unit/test_consumer_window.c src/consumer_int.h \
 include/idem/consumer.h include/idem/error.h include/idem/handler.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h include/idem/log.h src/backoff.h \
 src/envelope.h src/metrics.h src/pg.h src/registry.h src/rmq.h
src/consumer_int.h:
include/idem/consumer.h:
include/idem/error.h:
include/idem/handler.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
include/idem/log.h:
src/backoff.h:
src/envelope.h:
src/metrics.h:
src/pg.h:
src/registry.h:
src/rmq.h:
