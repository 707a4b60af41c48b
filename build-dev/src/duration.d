build-dev/src/duration.o: src/duration.c include/idem/duration.h \
 include/idem/error.h
include/idem/duration.h:
include/idem/error.h:
