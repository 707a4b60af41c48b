build-dev/src/pg_pipeline.o: src/pg_pipeline.c src/pg_int.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h src/backoff.h src/pg.h \
 include/idem/error.h
src/pg_int.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
src/backoff.h:
src/pg.h:
include/idem/error.h:
