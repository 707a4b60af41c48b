build-dev/src/backoff.o: src/backoff.c src/backoff.h
src/backoff.h:
