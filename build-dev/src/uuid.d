build-dev/src/uuid.o: src/uuid.c include/idem/uuid.h src/uuid.h
include/idem/uuid.h:
src/uuid.h:
