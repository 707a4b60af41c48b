build-dev/src/metrics.o: src/metrics.c include/idem/idem.h \
 include/idem/error.h include/idem/log.h include/idem/duration.h \
 include/idem/handler.h /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h include/idem/consumer.h \
 include/idem/outbox.h include/idem/uuid.h include/idem/relay.h \
 include/idem/ops.h src/metrics.h src/envelope.h src/metrics_http.h
include/idem/idem.h:
include/idem/error.h:
include/idem/log.h:
include/idem/duration.h:
include/idem/handler.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
include/idem/consumer.h:
include/idem/outbox.h:
include/idem/uuid.h:
include/idem/relay.h:
include/idem/ops.h:
src/metrics.h:
src/envelope.h:
src/metrics_http.h:
