build-dev/src/policy.o: src/policy.c src/policy.h
src/policy.h:
