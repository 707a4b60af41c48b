build-dev/tests/unit/test_error: tests/unit/test_error.c \
 include/idem/error.h
include/idem/error.h:
