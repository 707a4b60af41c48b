build-dev/src/outbox.o: src/outbox.c include/idem/outbox.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h include/idem/error.h src/pg.h
include/idem/outbox.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
include/idem/error.h:
src/pg.h:
