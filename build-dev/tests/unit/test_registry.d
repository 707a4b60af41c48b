build-dev/tests/unit/test_registry: tests/unit/test_registry.c \
 include/idem/error.h src/registry.h include/idem/handler.h \
 /usr/include/postgresql/libpq-fe.h \
 /usr/include/postgresql/postgres_ext.h \
 /usr/include/postgresql/pg_config_ext.h
include/idem/error.h:
src/registry.h:
include/idem/handler.h:
/usr/include/postgresql/libpq-fe.h:
/usr/include/postgresql/postgres_ext.h:
/usr/include/postgresql/pg_config_ext.h:
