# idem - exactly-once billing events on PostgreSQL and RabbitMQ.
# Plain Makefile: explicit source lists, generated header dependencies.

PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
BUILD ?= build
CC ?= cc
SAN ?=

# The version lives in include/idem/idem.h only; the library's file names and idem.pc follow it.
VERSION := $(shell sed -n 's/.*define IDEM_VERSION "\(.*\)".*/\1/p' include/idem/idem.h)
SOMAJOR := $(firstword $(subst ., ,$(VERSION)))

PKGS := libpq librabbitmq jansson openssl
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS = $(shell pkg-config --libs $(PKGS) 2>/dev/null)

# CPPFLAGS, CFLAGS and LDFLAGS from the environment or the command line are added to what the
# build needs (the project's include paths come first, so the checkout's headers win over an
# installed idem's). -Werror is the project's own checks' (make test, make check, make sanitize
# pass WERROR=1), never a packager's plain `make` with another compiler.
STD_CFLAGS := -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE
WARN := -Wall -Wextra -Wstrict-prototypes -Wwrite-strings -Wshadow -Wno-unused-parameter
WERROR ?= 0
ifeq ($(WERROR),1)
WARN += -Werror
endif
CFLAGS ?= -O2 -g
CPPFLAGS ?=
LDFLAGS ?=
ALL_CFLAGS = -Iinclude $(SRC_INC) -Ihandlers $(STD_CFLAGS) $(WARN) $(CPPFLAGS) $(CFLAGS) -fPIC \
	$(PKG_CFLAGS) -MMD -MP
ifneq ($(SAN),)
SANFLAGS = -fsanitize=$(SAN) -fno-omit-frame-pointer
ALL_CFLAGS += $(SANFLAGS)
LDSAN = -fsanitize=$(SAN)
endif
LDLIBS_ALL = $(PKG_LIBS) -lm -lpthread

# src/ has a folder per layer, from the bottom: the utilities, the wire format, one folder per
# adapter, the core (what handlers and emitters see), the runtimes, the operations, the console,
# the commands. Files include each other by name (-I for each folder, as nginx does); which folder
# may include which is scripts/arch.py's table, checked by `make arch`.
SRC_DIRS := src/util src/wire src/adapters/pg src/adapters/rmq src/adapters/metrics src/core \
	src/consumer src/relay src/ops src/console src/cli
SRC_INC := $(addprefix -I,$(SRC_DIRS))

LIB_SRCS := \
	src/util/error.c \
	src/util/log.c \
	src/util/mask.c \
	src/util/host.c \
	src/util/duration.c \
	src/util/backoff.c \
	src/util/clock.c \
	src/util/uuid.c \
	src/util/fault.c \
	src/util/notify.c \
	src/wire/envelope.c \
	src/wire/digest.c \
	src/adapters/pg/pg.c \
	src/adapters/pg/pg_exec.c \
	src/adapters/pg/pg_pipeline.c \
	src/adapters/pg/pg_where.c \
	src/adapters/pg/pg_async.c \
	src/adapters/pg/pg_array.c \
	src/adapters/pg/pg_schema.c \
	src/adapters/rmq/rmq_url.c \
	src/adapters/rmq/rmq.c \
	src/adapters/rmq/rmq_socket.c \
	src/adapters/rmq/rmq_topology.c \
	src/adapters/rmq/rmq_confirm.c \
	src/adapters/rmq/rmq_deliver.c \
	src/adapters/rmq/rmq_publish.c \
	src/adapters/rmq/rmq_describe.c \
	src/adapters/metrics/metrics.c \
	src/adapters/metrics/metrics_http.c \
	src/core/registry.c \
	src/core/policy.c \
	src/core/event.c \
	src/core/outbox.c \
	src/consumer/consumer.c \
	src/consumer/consumer_claim.c \
	src/consumer/consumer_inbox.c \
	src/consumer/consumer_sql.c \
	src/consumer/consumer_topology.c \
	src/consumer/consumer_tx.c \
	src/consumer/consumer_window.c \
	src/consumer/consumer_ops.c \
	src/consumer/consumer_log.c \
	src/relay/relay.c \
	src/relay/relay_claim.c \
	src/relay/relay_wake.c \
	src/relay/relay_batch.c \
	src/relay/relay_ops.c \
	src/ops/migrate.c \
	src/ops/retain.c \
	src/ops/status.c \
	src/ops/replay.c \
	src/ops/dlq.c \
	src/console/console.c \
	src/console/console_api.c

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
	src/cli/cmd_ops.c \
	src/cli/cmd_dlq.c \
	src/cli/cmd_console.c

UNIT_TESTS := \
	tests/unit/test_duration \
	tests/unit/test_envelope \
	tests/unit/test_digest \
	tests/unit/test_registry \
	tests/unit/test_error \
	tests/unit/test_mask \
	tests/unit/test_backoff \
	tests/unit/test_uuid \
	tests/unit/test_billing_payload \
	tests/unit/test_args \
	tests/unit/test_policy \
	tests/unit/test_consumer_window \
	tests/unit/test_relay_gap \
	tests/unit/test_log \
	tests/unit/test_host \
	tests/unit/test_event \
	tests/unit/test_envelope_suite \
	tests/unit/test_fuzz_regressions

# The console's page, embedded in the library: make turns each file into a C array (od is in
# coreutils, so nothing more is needed to build) in $(BUILD)/gen/console_assets.c.
CONSOLE_ASSETS := \
	src/console/assets/index.html \
	src/console/assets/console.css \
	src/console/assets/console.js \
	src/console/assets/favicon.svg

LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/%.o) $(BUILD)/gen/console_assets.o
HANDLER_OBJS := $(HANDLER_SRCS:%.c=$(BUILD)/%.o)
CLI_OBJS := $(CLI_SRCS:%.c=$(BUILD)/%.o)
UNIT_BINS := $(UNIT_TESTS:%=$(BUILD)/%)

.PHONY: all test test-slow check unit arch integration sanitize bench demo chaos chaos-all install \
	valgrind format format-check clean deps dev-servers dev-servers-stop FORCE

all: $(BUILD)/idem $(BUILD)/libidem.a $(BUILD)/libidem.so $(BUILD)/libidem.so.$(SOMAJOR) \
	$(BUILD)/idem-uninstalled.pc

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/gen/console_assets.c: $(CONSOLE_ASSETS) Makefile
	@mkdir -p $(dir $@)
	@{ echo '/* generated by make from src/console/assets/: do not edit */'; \
	  echo '#include "console_int.h"'; i=0; \
	  for f in $(CONSOLE_ASSETS); do \
	    echo "static const unsigned char a$$i[] = {"; \
	    od -An -v -tx1 $$f | sed -e 's/ \([0-9a-f][0-9a-f]\)/0x\1,/g'; echo '0};'; i=$$((i+1)); \
	  done; \
	  echo 'const idemp_console_asset_t idemp_console_assets[] = {'; i=0; \
	  for f in $(CONSOLE_ASSETS); do \
	    echo "{\"/$${f##*/}\", sizeof a$$i - 1, a$$i},"; i=$$((i+1)); \
	  done; \
	  echo '{0, 0, 0}};'; } >$@.tmp && mv $@.tmp $@

$(BUILD)/gen/console_assets.o: $(BUILD)/gen/console_assets.c
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/libidem.a: $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# SONAME libidem.so.$(SOMAJOR); src/libidem.map exports the idem_* symbols and nothing else.
$(BUILD)/libidem.so.$(VERSION): $(LIB_OBJS) src/libidem.map
	$(CC) -shared -Wl,-soname,libidem.so.$(SOMAJOR) -Wl,--version-script=src/libidem.map \
		-o $@ $(LIB_OBJS) $(LDFLAGS) $(LDSAN) $(LDLIBS_ALL)

$(BUILD)/libidem.so.$(SOMAJOR) $(BUILD)/libidem.so: $(BUILD)/libidem.so.$(VERSION)
	ln -sf libidem.so.$(VERSION) $@

# The uninstalled idem.pc: with PKG_CONFIG_PATH=$(BUILD), `pkg-config --cflags --libs idem`
# compiles and links a program against this build (the checkout's headers, $(BUILD)/libidem.so
# found at run time through an rpath, the sanitizers of SAN=), and its variables cc and cflags are
# this build's compiler and language and warning flags. The tests build their C programs with it
# and nothing else. Rewritten only when its text changes.
$(BUILD)/idem-uninstalled.pc: idem.pc.in FORCE
	@mkdir -p $(dir $@)
	@{ printf 'cc=%s\ncflags=%s\n' '$(CC)' '$(STD_CFLAGS) $(filter-out -Werror,$(WARN)) -Werror'; \
	  sed -e 's|^prefix=.*|prefix=$(CURDIR)|' -e 's|^libdir=.*|libdir=$(abspath $(BUILD))|' \
	    -e 's|^includedir=.*|includedir=$${prefix}/include|' -e 's|@VERSION@|$(VERSION)|g' \
	    -e 's|^Cflags: .*|&$(if $(SANFLAGS), $(SANFLAGS))|' \
	    -e 's|^Libs: -L$${libdir}|& -Wl,-rpath,$${libdir}|' \
	    -e 's|^Libs: .*|&$(if $(LDSAN), $(LDSAN))|' \
	    idem.pc.in; } >$@.tmp
	@if cmp -s $@.tmp $@; then rm -f $@.tmp; else mv $@.tmp $@; fi

$(BUILD)/idem: $(CLI_OBJS) $(HANDLER_OBJS) $(BUILD)/libidem.a
	$(CC) -o $@ $(CLI_OBJS) $(HANDLER_OBJS) $(BUILD)/libidem.a $(LDFLAGS) $(LDSAN) $(LDLIBS_ALL)

# A unit test links what it tests: its own objects below, and from the static library only the
# members it references.
UNIT_OBJS_test_args := $(BUILD)/src/cli/args.o
UNIT_OBJS_test_billing_payload := $(BUILD)/handlers/billing_payload.o

$(BUILD)/tests/unit/%: tests/unit/%.c $(HANDLER_OBJS) $(CLI_OBJS) $(BUILD)/libidem.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -o $@ $< $(UNIT_OBJS_$*) $(BUILD)/libidem.a \
		$(LDFLAGS) $(LDSAN) $(LDLIBS_ALL) -lcmocka

unit: $(UNIT_BINS)
	@failed=0; for t in $(UNIT_BINS); do $$t || failed=1; done; exit $$failed

deps:
	scripts/deps.sh

# The test command: installs what is missing, builds, runs the unit tests, then the
# integration tests against private PostgreSQL and RabbitMQ started for the run, less the slow
# ones (pytest markers cluster and slow, tests/integration/pytest.ini). `make test-slow` runs
# exactly those; .ci/run runs both, `make integration` all of them at once.
SLOW_TESTS = cluster or slow
test: deps
	$(MAKE) WERROR=1 all unit arch
	scripts/integration.sh -m "not ($(SLOW_TESTS))" --durations=15

test-slow: deps
	$(MAKE) WERROR=1 all
	scripts/integration.sh -m "$(SLOW_TESTS)" --durations=15

# The module graph: no cycle, no upward include, the client libraries only in their adapters.
arch:
	/usr/bin/python3 scripts/arch.py

check: test

integration: all
	scripts/integration.sh

# The same suites against an AddressSanitizer + UndefinedBehaviorSanitizer build in build-san/;
# reports go to build-san/reports/ and fail the target.
sanitize: deps
	$(MAKE) BUILD=build-san SAN=address,undefined CFLAGS="-O1 -g" WERROR=1 all unit
	rm -rf build-san/reports && mkdir -p build-san/reports
	IDEM_BIN=$(CURDIR)/build-san/idem IDEM_SQL_DIR=$(CURDIR)/sql \
	ASAN_OPTIONS=log_path=$(CURDIR)/build-san/reports/asan:verify_asan_link_order=0 \
	UBSAN_OPTIONS=log_path=$(CURDIR)/build-san/reports/ubsan:print_stacktrace=1 \
	scripts/integration.sh
	@if [ -n "$$(ls build-san/reports)" ]; then cat build-san/reports/*; exit 1; fi

# The relay and the consumer under valgrind over 5,000 events: no errors, no definite leaks.
valgrind: deps
	$(MAKE) all
	scripts/valgrind.sh 5000

# The benchmark (bench/README.md): private durable servers, every figure beside its limit;
# writes bench/results/latest.{md,json,svg}. BENCH_ARGS passes flags (e.g. BENCH_ARGS=--quick;
# BENCH_QUICK=1 does the same). See /usr/bin/python3 bench/bench.py --help.
bench: deps
	$(MAKE) all
	/usr/bin/python3 bench/bench.py --idem $(abspath $(BUILD))/idem \
		--tools $(abspath $(BUILD))/bench $(BENCH_ARGS)

# The demo: a billing scenario with crashes, then an exactly-once audit; draws
# $(BUILD)/demo/timeline.svg. See scripts/demo.py --help.
demo: deps
	$(MAKE) all
	/usr/bin/python3 scripts/demo.py --out $(BUILD)/demo

# Private PostgreSQL and RabbitMQ for trying idem on an application of one's own: prints the
# export lines of IDEM_PG_URL and IDEM_AMQP_URL (eval "$$(make -s dev-servers)" sets them);
# dev-servers-stop stops them, keeping their data. See scripts/dev-servers --help.
dev-servers: deps
	@scripts/dev-servers start

dev-servers-stop:
	@scripts/dev-servers stop

# The chaos audit: the billing scenario at scale (>= 50,000 events) under injected faults, then
# an exactly-once, in-order audit. SEED=n replays a run's scenario and fault plan; TOPOLOGY=plain
# or partitioned (the default) picks the consumer group; CHAOS_ARGS passes more flags (e.g.
# CHAOS_ARGS=--quick). chaos-all runs each of SEEDS (default 1 2 3 4 5) in both topologies, one
# run at a time, and prints a table. See scripts/chaos.py --help.
chaos: deps
	$(MAKE) all
	/usr/bin/python3 scripts/chaos.py $(if $(SEED),--seed $(SEED)) \
		$(if $(TOPOLOGY),--topology $(TOPOLOGY)) $(CHAOS_ARGS)

chaos-all: deps
	$(MAKE) all
	/usr/bin/python3 scripts/chaos.py --seeds "$(or $(SEEDS),1 2 3 4 5)" $(CHAOS_ARGS)

# Where `make install` puts things (DESTDIR stages them; PREFIX and LIBDIR are what the installed
# files name). `make uninstall` removes exactly these files, and no directory.
BINDIR = $(PREFIX)/bin
INCDIR = $(PREFIX)/include/idem
DATADIR = $(PREFIX)/share/idem
MAN1DIR = $(PREFIX)/share/man/man1
PCDIR = $(LIBDIR)/pkgconfig
PC_LIBDIR = $(patsubst $(PREFIX)/%,$${prefix}/%,$(LIBDIR))
KIT_UNITS = idem-relay.service idem-consume@.service
INSTALLED = $(BINDIR)/idem $(LIBDIR)/libidem.a $(LIBDIR)/libidem.so.$(VERSION) \
	$(LIBDIR)/libidem.so.$(SOMAJOR) $(LIBDIR)/libidem.so $(PCDIR)/idem.pc \
	$(addprefix $(INCDIR)/,$(notdir $(wildcard include/idem/*.h))) \
	$(addprefix $(DATADIR)/sql/,$(notdir $(wildcard sql/*.sql))) \
	$(addprefix $(DATADIR)/sql/billing/,$(notdir $(wildcard sql/billing/*.sql))) \
	$(addprefix $(DATADIR)/systemd/,$(KIT_UNITS) idem.sysusers.conf) \
	$(addprefix $(DATADIR)/env/,$(notdir $(wildcard deploy/env/*.env.example))) \
	$(DATADIR)/idem.1 $(MAN1DIR)/idem.1 $(DATADIR)/grafana-idem.json

.PHONY: uninstall
install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PCDIR) \
		$(DESTDIR)$(INCDIR) $(DESTDIR)$(DATADIR)/sql/billing
	install -m755 $(BUILD)/idem $(DESTDIR)$(BINDIR)/idem
	install -m644 $(BUILD)/libidem.a $(DESTDIR)$(LIBDIR)/libidem.a
	install -m755 $(BUILD)/libidem.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libidem.so.$(VERSION)
	ln -sf libidem.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libidem.so.$(SOMAJOR)
	ln -sf libidem.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libidem.so
	install -m644 include/idem/*.h $(DESTDIR)$(INCDIR)/
	install -m644 sql/*.sql $(DESTDIR)$(DATADIR)/sql/
	install -m644 sql/billing/*.sql $(DESTDIR)$(DATADIR)/sql/billing/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(PC_LIBDIR)|g' -e 's|@VERSION@|$(VERSION)|g' \
		idem.pc.in > $(BUILD)/idem.pc
	install -m644 $(BUILD)/idem.pc $(DESTDIR)$(PCDIR)/idem.pc

# The deployment kit (deploy/): systemd units and a sysusers.d entry, example environment files,
# the man page, the Grafana dashboard.
KIT_DIR = $(DESTDIR)$(DATADIR)
KIT_SED = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@BINDIR@|$(BINDIR)|g' \
	-e 's|@DATADIR@|$(DATADIR)|g' -e 's|@VERSION@|$(VERSION)|g'

.PHONY: install-kit
install: install-kit
install-kit:
	install -d $(KIT_DIR)/systemd $(KIT_DIR)/env $(DESTDIR)$(MAN1DIR)
	for f in $(KIT_UNITS); do \
		$(KIT_SED) deploy/systemd/$$f.in > $(KIT_DIR)/systemd/$$f && \
		chmod 644 $(KIT_DIR)/systemd/$$f || exit 1; done
	install -m644 deploy/systemd/idem.sysusers.conf $(KIT_DIR)/systemd/
	install -m644 deploy/env/*.env.example $(KIT_DIR)/env/
	$(KIT_SED) deploy/idem.1.in > $(KIT_DIR)/idem.1 && chmod 644 $(KIT_DIR)/idem.1
	install -m644 $(KIT_DIR)/idem.1 $(DESTDIR)$(MAN1DIR)/idem.1
	install -m644 deploy/grafana/grafana-idem.json $(KIT_DIR)/

# Removes the files `install` put there (with the same DESTDIR, PREFIX and LIBDIR), nothing else:
# directories stay, as they may hold other packages' files.
uninstall:
	rm -f $(addprefix $(DESTDIR),$(INSTALLED))

FORMAT_FILES = $(wildcard $(addsuffix /*.c,$(SRC_DIRS)) $(addsuffix /*.h,$(SRC_DIRS)) \
	include/idem/*.h handlers/*.c handlers/*.h tests/unit/*.c bench/*.c bench/*.h)
FORMAT_FILES += $(wildcard examples/*/*.c tests/integration/progs/*.c)

format:
	clang-format -i $(FORMAT_FILES)

format-check:
	clang-format --dry-run --Werror $(FORMAT_FILES)

clean:
	rm -rf $(BUILD) build-san

-include $(LIB_OBJS:.o=.d) $(HANDLER_OBJS:.o=.d) $(CLI_OBJS:.o=.d)

# ---- fuzzing (libFuzzer; Debian's clang and libclang-rt-14-dev) ----------------------------------
# `make fuzz` builds the targets of tests/fuzz/ with ASan + UBSan into build/fuzz/ and runs each
# for FUZZ_SECONDS (default 60) from its committed corpus, tests/fuzz/corpus/TARGET/ (which also
# holds the inputs of past crashes, regress-*: they fail the run until fixed). New inputs go to
# build/fuzz/corpus/TARGET/, crashes to build/fuzz/artifacts/TARGET/. `make fuzz-build` only builds.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 60
FUZZ_DIR = $(BUILD)/fuzz
FUZZ_TARGETS := fuzz_envelope fuzz_billing_payload fuzz_amqp_url_mask fuzz_props_envelope \
	fuzz_digest
FUZZ_SAN = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS = $(STD_CFLAGS) -g -O1 $(FUZZ_SAN) \
	-Iinclude $(SRC_INC) -Ihandlers $(PKG_CFLAGS)
FUZZ_LIB_OBJS := $(LIB_SRCS:%.c=$(FUZZ_DIR)/%.o)
FUZZ_HANDLER_OBJS := $(HANDLER_SRCS:%.c=$(FUZZ_DIR)/%.o)
FUZZ_BINS := $(FUZZ_TARGETS:%=$(FUZZ_DIR)/%)

.PHONY: fuzz fuzz-build fuzz-deps

fuzz-deps:
	scripts/deps.sh --fuzz

$(FUZZ_DIR)/src/%.o $(FUZZ_DIR)/handlers/%.o: FUZZ_EXTRA = -fsanitize=fuzzer-no-link
$(FUZZ_DIR)/src/%.o: src/%.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_EXTRA) -MMD -MP -c $< -o $@
$(FUZZ_DIR)/handlers/%.o: handlers/%.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_EXTRA) -MMD -MP -c $< -o $@

$(FUZZ_DIR)/libidem-fuzz.a: $(FUZZ_LIB_OBJS) $(FUZZ_HANDLER_OBJS)
	rm -f $@ && ar rcs $@ $^

# The archive: a target that includes a library source (fuzz_props_envelope) leaves its object out.
$(FUZZ_DIR)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_common.h $(FUZZ_DIR)/libidem-fuzz.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -MMD -MP -o $@ $< $(FUZZ_DIR)/libidem-fuzz.a \
		$(PKG_LIBS) -lm -lpthread

fuzz-build: fuzz-deps
	$(MAKE) $(FUZZ_BINS)

fuzz: fuzz-build
	@failed=0; for t in $(FUZZ_TARGETS); do \
		tests/fuzz/run.sh $(FUZZ_DIR)/$$t $(FUZZ_SECONDS) || failed=1; done; exit $$failed

-include $(FUZZ_LIB_OBJS:.o=.d) $(FUZZ_HANDLER_OBJS:.o=.d) $(FUZZ_BINS:=.d)
