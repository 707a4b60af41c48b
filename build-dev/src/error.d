build-dev/src/error.o: src/error.c include/idem/error.h src/mask.h
include/idem/error.h:
src/mask.h:
