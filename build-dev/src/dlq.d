build-dev/src/dlq.o: src/dlq.c include/idem/ops.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h include/idem/error.h src/clock.h \
 src/envelope.h src/mask.h src/rmq.h src/uuid.h
include/idem/ops.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
include/idem/error.h:
src/clock.h:
src/envelope.h:
src/mask.h:
src/rmq.h:
src/uuid.h:
