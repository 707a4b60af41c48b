build-dev/src/retain.o: src/retain.c include/idem/ops.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h include/idem/error.h src/pg.h
include/idem/ops.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
include/idem/error.h:
src/pg.h:
