build-dev/src/pg_array.o: src/pg_array.c src/pg.h include/idem/error.h
src/pg.h:
include/idem/error.h:
