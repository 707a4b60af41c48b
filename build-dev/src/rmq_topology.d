build-dev/src/rmq_topology.o: src/rmq_topology.c src/rmq_int.h \
 src/backoff.h src/rmq.h include/idem/error.h src/envelope.h
src/rmq_int.h:
src/backoff.h:
src/rmq.h:
include/idem/error.h:
src/envelope.h:
