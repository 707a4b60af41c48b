build-dev/tests/unit/test_envelope_suite: \
 tests/unit/test_envelope_suite.c src/envelope.h
src/envelope.h:
