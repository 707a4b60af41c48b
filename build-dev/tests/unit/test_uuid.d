build-dev/tests/unit/test_uuid: tests/unit/test_uuid.c \
 include/idem/uuid.h src/uuid.h
include/idem/uuid.h:
src/uuid.h:
