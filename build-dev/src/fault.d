build-dev/src/fault.o: src/fault.c include/idem/log.h src/fault.h
include/idem/log.h:
src/fault.h:
