build-dev/tests/unit/test_mask: tests/unit/test_mask.c \
 include/idem/error.h src/mask.h src/pg.h src/rmq.h src/envelope.h
include/idem/error.h:
src/mask.h:
src/pg.h:
src/rmq.h:
src/envelope.h:
