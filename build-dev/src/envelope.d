build-dev/src/envelope.o: src/envelope.c src/envelope.h src/uuid.h
src/envelope.h:
src/uuid.h:
