build-dev/tests/unit/test_args: tests/unit/test_args.c src/cli/args.h \
 include/idem/log.h
src/cli/args.h:
include/idem/log.h:
