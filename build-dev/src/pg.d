build-dev/src/pg.o: src/pg.c /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h include/idem/log.h src/backoff.h \
 src/clock.h src/mask.h src/pg_int.h src/pg.h include/idem/error.h
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
include/idem/log.h:
src/backoff.h:
src/clock.h:
src/mask.h:
src/pg_int.h:
src/pg.h:
include/idem/error.h:
