build-dev/src/event.o: src/event.c src/event.h include/idem/handler.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h src/pg.h include/idem/error.h \
 src/rmq.h src/envelope.h src/mask.h src/policy.h
src/event.h:
include/idem/handler.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
src/pg.h:
include/idem/error.h:
src/rmq.h:
src/envelope.h:
src/mask.h:
src/policy.h:
