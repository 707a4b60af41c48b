build-dev/tests/unit/test_duration: tests/unit/test_duration.c \
 include/idem/duration.h include/idem/error.h
include/idem/duration.h:
include/idem/error.h:
