# idem - exactly-once billing events on PostgreSQL and RabbitMQ.
# Plain Makefile: explicit source lists, generated header dependencies.

PREFIX ?= /usr/local
BUILD ?= build
CC ?= cc
SAN ?=

PKGS := libpq librabbitmq jansson libmicrohttpd
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS = $(shell pkg-config --libs $(PKGS) 2>/dev/null)

WARN := -Wall -Wextra -Wstrict-prototypes -Wwrite-strings -Wshadow -Wno-unused-parameter -Werror
CFLAGS ?= -O2 -g
ALL_CFLAGS = -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE $(WARN) $(CFLAGS) -fPIC \
	-Iinclude -Isrc -Ihandlers $(PKG_CFLAGS) -MMD -MP
ifneq ($(SAN),)
ALL_CFLAGS += -fsanitize=$(SAN) -fno-omit-frame-pointer
LDSAN = -fsanitize=$(SAN)
endif
LDLIBS_ALL = $(PKG_LIBS) -lm -lpthread

LIB_SRCS := \
	src/error.c \
	src/log.c \
	src/mask.c \
	src/duration.c \
	src/backoff.c \
	src/clock.c \
	src/uuid.c \
	src/fault.c \
	src/pg.c \
	src/rmq.c \
	src/envelope.c \
	src/registry.c \
	src/event.c \
	src/consumer.c \
	src/outbox.c \
	src/relay.c \
	src/migrate.c \
	src/retain.c \
	src/status.c \
	src/replay.c \
	src/metrics.c

HANDLER_SRCS := \
	handlers/billing_payload.c \
	handlers/payment_failed.c \
	handlers/invoice_paid.c \
	handlers/receipt_requested.c \
	handlers/billing.c

CLI_SRCS := \
	src/cli/main.c \
	src/cli/args.c \
	src/cli/cmd_migrate.c \
	src/cli/cmd_consume.c \
	src/cli/cmd_relay.c \
	src/cli/cmd_emit.c \
	src/cli/cmd_ops.c

UNIT_TESTS := \
	tests/unit/test_duration \
	tests/unit/test_envelope \
	tests/unit/test_registry \
	tests/unit/test_error \
	tests/unit/test_mask \
	tests/unit/test_backoff \
	tests/unit/test_uuid \
	tests/unit/test_billing_payload \
	tests/unit/test_args

LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/%.o)
HANDLER_OBJS := $(HANDLER_SRCS:%.c=$(BUILD)/%.o)
CLI_OBJS := $(CLI_SRCS:%.c=$(BUILD)/%.o)
UNIT_BINS := $(UNIT_TESTS:%=$(BUILD)/%)

.PHONY: all test check unit integration sanitize bench demo chaos install format format-check clean deps

all: $(BUILD)/idem $(BUILD)/libidem.a $(BUILD)/libidem.so

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/libidem.a: $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/libidem.so: $(LIB_OBJS)
	$(CC) -shared -o $@ $^ $(LDSAN) $(LDLIBS_ALL)

$(BUILD)/idem: $(CLI_OBJS) $(HANDLER_OBJS) $(BUILD)/libidem.a
	$(CC) -o $@ $(CLI_OBJS) $(HANDLER_OBJS) $(BUILD)/libidem.a $(LDSAN) $(LDLIBS_ALL)

$(BUILD)/tests/unit/%: tests/unit/%.c $(HANDLER_OBJS) $(CLI_OBJS) $(BUILD)/libidem.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Isrc/cli -Ihandlers -o $@ $< \
		$(filter-out $(BUILD)/src/cli/main.o,$(CLI_OBJS)) $(HANDLER_OBJS) $(BUILD)/libidem.a \
		$(LDSAN) $(LDLIBS_ALL) -lcmocka

unit: $(UNIT_BINS)
	@failed=0; for t in $(UNIT_BINS); do $$t || failed=1; done; exit $$failed

deps:
	scripts/deps.sh

# The test command: installs what is missing, builds, runs the unit tests, then the
# integration tests against private PostgreSQL and RabbitMQ started for the run.
test: deps
	$(MAKE) all unit
	scripts/integration.sh

check: test

integration: all
	scripts/integration.sh

# The same suites against an AddressSanitizer + UndefinedBehaviorSanitizer build in build-san/;
# reports go to build-san/reports/ and fail the target.
sanitize: deps
	$(MAKE) BUILD=build-san SAN=address,undefined CFLAGS="-O1 -g" all unit
	rm -rf build-san/reports && mkdir -p build-san/reports
	IDEM_BIN=$(CURDIR)/build-san/idem IDEM_SQL_DIR=$(CURDIR)/sql \
	ASAN_OPTIONS=log_path=$(CURDIR)/build-san/reports/asan \
	UBSAN_OPTIONS=log_path=$(CURDIR)/build-san/reports/ubsan:print_stacktrace=1 \
	scripts/integration.sh
	@if [ -n "$$(ls build-san/reports)" ]; then cat build-san/reports/*; exit 1; fi

bench: deps
	$(MAKE) all
	bench/run.sh

demo: deps
	$(MAKE) all
	scripts/demo.sh

# The chaos audit: the billing scenario at scale (>= 50,000 events) under injected faults, then
# an exactly-once, in-order audit. SEED=n replays a run's scenario and fault plan; CHAOS_ARGS
# passes more flags (e.g. CHAOS_ARGS=--quick). See scripts/chaos.py --help.
chaos: deps
	$(MAKE) all
	/usr/bin/python3 scripts/chaos.py $(if $(SEED),--seed $(SEED)) $(CHAOS_ARGS)

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig \
		$(DESTDIR)$(PREFIX)/include/idem $(DESTDIR)$(PREFIX)/share/idem/sql
	install -m755 $(BUILD)/idem $(DESTDIR)$(PREFIX)/bin/idem
	install -m644 $(BUILD)/libidem.a $(DESTDIR)$(PREFIX)/lib/libidem.a
	install -m755 $(BUILD)/libidem.so $(DESTDIR)$(PREFIX)/lib/libidem.so
	install -m644 include/idem/*.h $(DESTDIR)$(PREFIX)/include/idem/
	install -m644 sql/*.sql $(DESTDIR)$(PREFIX)/share/idem/sql/
	sed -e 's|@PREFIX@|$(PREFIX)|g' idem.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/idem.pc

FORMAT_FILES = $(wildcard src/*.c src/*.h src/cli/*.c src/cli/*.h include/idem/*.h \
	handlers/*.c handlers/*.h tests/unit/*.c bench/*.c bench/*.h)

format:
	clang-format -i $(FORMAT_FILES)

format-check:
	clang-format --dry-run --Werror $(FORMAT_FILES)

clean:
	rm -rf $(BUILD) build-san

-include $(LIB_OBJS:.o=.d) $(HANDLER_OBJS:.o=.d) $(CLI_OBJS:.o=.d)
