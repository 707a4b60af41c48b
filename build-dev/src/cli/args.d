build-dev/src/cli/args.o: src/cli/args.c include/idem/duration.h \
 include/idem/error.h src/cli/args.h include/idem/log.h
include/idem/duration.h:
include/idem/error.h:
src/cli/args.h:
include/idem/log.h:
