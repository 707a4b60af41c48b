build-dev/tests/unit/test_envelope: tests/unit/test_envelope.c \
 src/envelope.h
src/envelope.h:
