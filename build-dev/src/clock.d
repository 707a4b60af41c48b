build-dev/src/clock.o: src/clock.c src/clock.h
src/clock.h:
