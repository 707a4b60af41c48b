build-dev/src/log.o: src/log.c include/idem/error.h include/idem/log.h \
 src/mask.h
include/idem/error.h:
include/idem/log.h:
src/mask.h:
