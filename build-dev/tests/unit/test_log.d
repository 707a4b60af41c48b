build-dev/tests/unit/test_log: tests/unit/test_log.c include/idem/log.h \
 src/mask.h
include/idem/log.h:
src/mask.h:
