build-dev/tests/unit/test_policy: tests/unit/test_policy.c src/policy.h
src/policy.h:
