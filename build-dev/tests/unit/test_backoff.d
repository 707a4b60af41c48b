build-dev/tests/unit/test_backoff: tests/unit/test_backoff.c \
 src/backoff.h
src/backoff.h:
