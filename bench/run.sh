#!/usr/bin/env bash
# bench/run.sh - the `make bench` driver: builds the raw broker tools, starts private PostgreSQL
# (durable defaults: fsync, synchronous_commit, full_page_writes on) and RabbitMQ instances in a
# temporary directory, runs bench/bench.py against them, and always stops them afterwards.
#
#   bench/run.sh [--quick] [bench.py flags...]      (see /usr/bin/python3 bench/bench.py --help)
#
# Results: bench/results/latest.md (the table, also printed) and bench/results/latest.json.
# Settings can also come from the environment: BENCH_EVENTS, BENCH_ROUNDS, BENCH_RELAYS,
# BENCH_BATCH, BENCH_RELAY_FLAGS, BENCH_CONSUMER_FLAGS, IDEM_BIN, ... (bench.py --help).
# BENCH_KEEP=1 keeps the temporary directory (server logs, bench-logs/ with idem's output).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=/usr/bin/python3 # Debian's, with python3-psycopg2 and python3-pika (not the pyenv shim)

log() { printf 'bench: %s\n' "$*" >&2; }

[ "$(id -u)" -eq 0 ] || {
  log "must run as root (scripts/services.sh runs PostgreSQL through runuser)"
  exit 1
}
"$PY" -c 'import psycopg2, pika' 2>/dev/null || {
  log "$PY lacks psycopg2 or pika (apt-get install python3-psycopg2 python3-pika; make deps)"
  exit 1
}
make -s -C bench tools BUILD="$ROOT/build"
[ -x "${IDEM_BIN:-build/idem}" ] || log "warning: ${IDEM_BIN:-build/idem} not built; only the limits and the recipe will be measured"

SVC=$(mktemp -d /tmp/idem-bench.XXXXXX)
BENCH_PID=""
# shellcheck disable=SC2317 # invoked by the traps
cleanup() {
  local rc=$?
  trap '' INT TERM
  trap - EXIT
  if [ -n "$BENCH_PID" ] && kill -0 "$BENCH_PID" 2>/dev/null; then
    kill -TERM "$BENCH_PID" 2>/dev/null || true
    wait "$BENCH_PID" 2>/dev/null || true
  fi
  scripts/services.sh stop "$SVC" >/dev/null 2>&1 || log "warning: stopping the servers in $SVC failed"
  if [ "${BENCH_KEEP:-0}" = 1 ]; then
    log "kept $SVC"
  else
    rm -rf -- "$SVC"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start=$SECONDS
envfile=$(scripts/services.sh start "$SVC" --durable)
# shellcheck disable=SC1090
. "$envfile"
export IDEM_PG_URL IDEM_AMQP_URL IDEM_SVC_DIR
log "servers up in $((SECONDS - start)) s ($SVC)"

# In the background so that a TERM to this script is handled at once (bash defers traps while a
# foreground child runs); bench.py stops its own children on TERM.
"$PY" bench/bench.py "$@" </dev/null &
BENCH_PID=$!
rc=0
wait "$BENCH_PID" || rc=$?
BENCH_PID=""
log "done in $((SECONDS - start)) s (exit $rc)"
exit "$rc"
