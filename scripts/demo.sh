#!/usr/bin/env bash
# scripts/demo.sh - idem's end-to-end demo (`make demo`): a small billing app emits a few thousand
# events, some of them twice, while relays and consumers are killed and crash at their worst
# moments; then every effect is audited. Exit 0 only if every audit line passes.
#
# Runs private PostgreSQL and RabbitMQ servers in a temporary directory (scripts/services.sh),
# always stopped at exit. Needs root (like services.sh), build/idem, psql and Debian's python3-pika
# (`make demo` installs and builds all of it). Takes about a minute.
#
# Environment: IDEM_DEMO_KEEP=1 keeps the temporary directory (logs, data) after the run; it is
# always kept when the demo fails.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IDEM=$ROOT/build/idem
SVC=$ROOT/scripts/services.sh
DEMO=$ROOT/scripts/demo
PY=/usr/bin/python3

CONSUMER=billing
QUEUE=billing.events.q
# The scenario. Phase 1 lasts PHASE1_TICKS x 100 ms.
DUNNING_SUBS=70
PAYING_SUBS=110
RECOVERING_SUBS=20
PHASE1_TICKS=200
REPLAY_PCT=10
DRAIN_TIMEOUT_S=40

# Faults, in tenths of a second after the workload starts.
T_KILL_RELAY=50
T_RESTART_RELAY=60
RELAY_FAULT=relay.after_publish:3
T_KILL_CONSUMER=90
T_RESTART_CONSUMER=100
CONSUMER_FAULT=consumer.after_commit:5
T_PHASE2_EARLIEST=80

# ------------------------------------------------------------------------------------ output

if [ -t 1 ]; then
  TTY=1
  B=$'\e[1m' DIM=$'\e[2m' GRN=$'\e[32m' RED=$'\e[31m' YEL=$'\e[33m' RST=$'\e[0m' CLR=$'\r\e[K'
else
  TTY=0 B='' DIM='' GRN='' RED='' YEL='' RST='' CLR=''
fi
PROGRESS_SHOWN=0

say() { printf '%s%s\n' "$CLR" "$*"; }
step() { say "${B}$*${RST}"; }
die() {
  say "${RED}demo: $*${RST}" >&"$ERR"
  exit 1
}
ERR=2

# -------------------------------------------------------------------------------- preflight

[ "$(id -u)" -eq 0 ] || die "run as root: the private PostgreSQL runs as user postgres (via runuser)"
[ -x "$IDEM" ] || die "$IDEM not found: run 'make' first (or 'make demo', which also installs deps)"
command -v psql >/dev/null || die "psql not found: run scripts/deps.sh (package postgresql-15)"
"$PY" -c 'import pika' 2>/dev/null || die "python3-pika not found: run scripts/deps.sh"

T_START=$SECONDS
WORK=$(mktemp -d /tmp/idem-demo.XXXXXX)
chmod 755 "$WORK" # user postgres must reach the data directory below it
LOGS=$WORK/logs
mkdir -p "$LOGS"
SVC_DIR=$WORK/svc
# The script's own stderr goes to a log: bash reports every background process that dies by a
# signal ("Killed"), and this demo kills processes on purpose. Errors are shown at exit.
exec 3>&2 2>>"$LOGS/demo.stderr"
ERR=3

# ------------------------------------------------------------------------- processes, cleanup

declare -A PID=() FAULT=() PORT=() INST=()
declare -A M_A=() M_D=() M_DL=() BASE_A=() BASE_D=() BASE_DL=()
declare -a EPID=()
PROCS=(consumer1 consumer2 relay1 relay2)
UNEXPECTED=()
FAILED_RUN=0

# alive PID: the process exists and is not a zombie.
alive() {
  local st
  [ -n "$1" ] || return 1
  read -r st 2>/dev/null <"/proc/$1/stat" || return 1
  st=${st##*) }
  [ "${st:0:1}" != Z ]
}

# stop_pids SECS PID...: SIGTERM, wait up to SECS, then SIGKILL. Only our own children.
stop_pids() {
  local secs=$1 pid n
  shift
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  n=$((secs * 10))
  for pid in "$@"; do
    while alive "$pid" && [ "$n" -gt 0 ]; do
      sleep 0.1
      n=$((n - 1))
    done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
  done
}

cleanup() {
  local rc=$? pids=() name pid
  trap '' INT TERM HUP
  trap - EXIT
  [ "$PROGRESS_SHOWN" = 1 ] && printf '\n'
  for name in "${PROCS[@]}"; do [ -n "${PID[$name]:-}" ] && pids+=("${PID[$name]}"); done
  for pid in "${EPID[@]}" "${PQ_ALIVE:-}"; do [ -n "$pid" ] && pids+=("$pid"); done
  if [ ${#pids[@]} -gt 0 ]; then
    stop_pids 5 "${pids[@]}"
    wait 2>/dev/null || true
  fi
  if [ -f "$SVC_DIR/state.sh" ]; then
    printf '%sstopping PostgreSQL and RabbitMQ ...' "$CLR"
    "$SVC" stop "$SVC_DIR" >>"$LOGS/services.log" 2>&1 || true
    printf ' stopped.\n'
  fi
  if [ "$rc" -ne 0 ] && grep -qv ' Killed ' "$LOGS/demo.stderr" 2>/dev/null; then
    say "demo's stderr:" >&3
    grep -v ' Killed ' "$LOGS/demo.stderr" | tail -20 >&3
  fi
  if [ "${IDEM_DEMO_KEEP:-0}" = 1 ] || { [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ]; } ||
    [ "$FAILED_RUN" = 1 ]; then
    say "logs kept in $LOGS (remove $WORK when done)"
  else
    rm -rf -- "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'say "${YEL}interrupted; stopping everything${RST}"; exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# start_proc NAME [FAULT]: starts (or restarts) a relay or consumer in the background.
start_proc() {
  local name=$1 fault=${2:-} args
  INST[$name]=$((${INST[$name]:-0} + 1))
  case $name in
    relay*) args=(relay) ;;
    consumer*) args=(consume --consumer "$CONSUMER" --queue "$QUEUE" --metrics-port "${PORT[$name]}") ;;
  esac
  printf -- '---- %s instance %d%s\n' "$name" "${INST[$name]}" "${fault:+ (IDEM_FAULT=$fault)}" \
    >>"$LOGS/$name.log"
  # setsid: a Ctrl-C on the terminal reaches this script only; cleanup stops the rest.
  if [ -n "$fault" ]; then
    IDEM_FAULT=$fault setsid "$IDEM" "${args[@]}" >>"$LOGS/$name.log" 2>&1 </dev/null &
  else
    env -u IDEM_FAULT setsid "$IDEM" "${args[@]}" >>"$LOGS/$name.log" 2>&1 </dev/null &
  fi
  PID[$name]=$!
  FAULT[$name]=$fault
}

# Consumer counters live in the process and start at 0 in each new instance: keep the last
# scrape of every instance and add it to the totals when the instance goes away.
scrape_raw() {
  local port=$1 line a='' d='' dl=0 fd
  exec {fd}<>"/dev/tcp/127.0.0.1/$port" || return 1
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&"$fd"
  while IFS= read -r -t 2 -u "$fd" line; do
    case $line in
      'idem_consumer_applied_total '*) a=${line##* } ;;
      'idem_consumer_duplicates_total '*) d=${line##* } ;;
      'idem_consumer_dead_lettered_total{'*) dl=$((dl + ${line##* })) ;;
    esac
  done
  exec {fd}>&-
  [ -n "$a" ] && [ -n "$d" ] && echo "$a $d $dl"
}
scrape() {
  local name=$1 out
  [ -n "${PID[$name]:-}" ] && [ -n "${PORT[$name]:-}" ] || return 0
  out=$(scrape_raw "${PORT[$name]}" 2>/dev/null) || return 0
  read -r "M_A[$name]" "M_D[$name]" "M_DL[$name]" <<<"$out"
}
retire_metrics() {
  local name=$1
  BASE_A[$name]=$((${BASE_A[$name]:-0} + ${M_A[$name]:-0}))
  BASE_D[$name]=$((${BASE_D[$name]:-0} + ${M_D[$name]:-0}))
  BASE_DL[$name]=$((${BASE_DL[$name]:-0} + ${M_DL[$name]:-0}))
  M_A[$name]=0 M_D[$name]=0 M_DL[$name]=0
}
metric_total() { # metric_total A|D|DL
  local name sum=0 m b
  for name in consumer1 consumer2; do
    m="M_$1[$name]" b="BASE_$1[$name]"
    sum=$((sum + ${!m:-0} + ${!b:-0}))
  done
  echo "$sum"
}

psqlq() { psql -X -q -v ON_ERROR_STOP=1 -d "$IDEM_PG_URL" "$@"; }

queue_depths() { "$PY" "$DEMO/queues.py" "$IDEM_AMQP_URL" "$QUEUE" "$QUEUE.dlq" 2>>"$LOGS/queues.log"; }

free_ports() {
  "$PY" -c 'import socket,sys
socks=[socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# ------------------------------------------------------------------------------------ intro

cat <<EOF
${B}idem demo: billing events that take effect exactly once${RST}

A small subscription-billing app (scripts/demo/schema.sql) marks invoices paid or failed and, in
the same database transaction, queues an event with idem_emit(). Relays publish the outbox to
RabbitMQ; consumers apply each event with idem's bundled billing handlers:
  payment.failed     -> the subscription's dunning step + 1
  invoice.paid       -> one revenue entry, dunning reset to 0, and a receipt.requested event
  receipt.requested  -> one receipt ("e-mail sent")
Meanwhile about ${REPLAY_PCT}% of the business operations are re-run with the same dedup key, and a
relay and a consumer are each SIGKILLed and then crash at their most awkward moment. At the
end every effect is checked against the business plan.

EOF

# ------------------------------------------------------------------------------------ setup

step "[1/5] Starting private PostgreSQL 15 and RabbitMQ (about 7 s) ..."
t0=$SECONDS
ENVFILE=$("$SVC" start "$SVC_DIR" 2>>"$LOGS/services.log") ||
  die "could not start the servers; see $LOGS/services.log"
# shellcheck disable=SC1090
. "$ENVFILE"
say "      PostgreSQL on 127.0.0.1:$IDEM_PG_PORT, RabbitMQ on 127.0.0.1:$IDEM_AMQP_PORT (up in $((SECONDS - t0)) s)"

step "[2/5] Creating the schemas and the workload"
"$IDEM" migrate >"$LOGS/migrate.log" 2>&1 || die "idem migrate failed; see $LOGS/migrate.log"
say "      idem migrate: $(grep -c '^applied' "$LOGS/migrate.log" || true) migrations applied (event_outbox, consumed_events, billing tables)"
psqlq -f "$DEMO/schema.sql" >>"$LOGS/setup.log" 2>&1 || die "demo schema failed; see $LOGS/setup.log"
psqlq -o /dev/null -v dunning_subs=$DUNNING_SUBS -v paying_subs=$PAYING_SUBS \
  -v recovering_subs=$RECOVERING_SUBS -v ticks=$PHASE1_TICKS -v replay_pct=$REPLAY_PCT \
  -f "$DEMO/plan.sql" >>"$LOGS/setup.log" 2>&1 || die "workload plan failed; see $LOGS/setup.log"
for s in 1 2 3; do
  psqlq -A -t -v session=$s -f "$DEMO/render.sql" >"$WORK/session$s.sql" 2>>"$LOGS/setup.log" ||
    die "rendering session $s failed; see $LOGS/setup.log"
done
read -r N_OPS N_REPLAYS N_DISTINCT N_INVOICES < <(psqlq -A -t -F ' ' -c "
  SELECT count(*), count(*) FILTER (WHERE is_replay),
         (SELECT count(*) FROM (SELECT DISTINCT kind, invoice_id, attempt_no FROM demo.ops) d),
         (SELECT count(*) FROM invoices)
  FROM demo.ops")
say "      $((DUNNING_SUBS + PAYING_SUBS + RECOVERING_SUBS)) subscriptions, $N_INVOICES invoices: $DUNNING_SUBS 'dunning' (payments only fail), $PAYING_SUBS 'paying'"
say "      (invoices only get paid), $RECOVERING_SUBS 'recovering' (fail first, pay once the failures are consumed)."
say "      $N_DISTINCT business operations + $N_REPLAYS replays = $N_OPS transactions, each like:"
say "${DIM}        BEGIN;"
say "        UPDATE invoices SET status = 'paid', paid_at = now()"
say "          WHERE invoice_id = \$1 AND status <> 'paid';"
say "        SELECT idem_emit('invoice.paid', subscription_id, invoice_id || ':paid', payload)"
say "          FROM invoice_events WHERE invoice_id = \$1;"
say "        COMMIT;${RST}"
say "      Failed payments likewise: status 'failed', event payment.failed,"
say "      dedup key invoice_id || ':failed:' || attempt_no."

step "[3/5] Starting 2 consumers and 2 relays"
read -r "PORT[consumer1]" "PORT[consumer2]" <<<"$(free_ports 2)"
start_proc consumer1
start_proc consumer2
# The consumers declare the exchange, the queue and its bindings: wait for them before
# publishing, or the first messages would be unroutable.
n=150
until grep -q 'consuming' "$LOGS/consumer1.log" && grep -q 'consuming' "$LOGS/consumer2.log" &&
  [ "$(queue_depths)" = "0 0" ]; do
  n=$((n - 1))
  [ "$n" -gt 0 ] || die "the consumers did not start consuming within 15 s; see $LOGS/consumer*.log"
  for name in consumer1 consumer2; do
    alive "${PID[$name]}" || die "$name exited at start; see $LOGS/$name.log"
  done
  sleep 0.1
done
start_proc relay1
start_proc relay2
say "      consumers: idem consume --consumer $CONSUMER --queue $QUEUE  (competing on one queue)"
say "      relays:    idem relay  (two at once; they share the outbox safely)"

# ------------------------------------------------------------------------------ the workload

step "[4/5] Running the workload (about $((PHASE1_TICKS / 10 + 5)) s)"
cat <<EOF
${DIM}      emitted    business transactions committed (replays included)
      pending    outbox rows not yet published      published  outbox rows sent to RabbitMQ
      consumed   ledger rows (events applied)       dead       dead-lettered messages
      dups       duplicates suppressed: replays collapsed in the outbox + redeliveries ignored${RST}
EOF

T0_US=${EPOCHREALTIME//[!0-9]/}
NOW=0
update_now() {
  local t=${EPOCHREALTIME//[!0-9]/}
  NOW=$(((t - T0_US) / 100000))
}
fmt_t() { printf '%d.%ds' $(($1 / 10)) $(($1 % 10)); }
# event LINE [MORE...]: a timestamped line, more lines indented below it.
event() {
  local l
  say "  $(printf '%6s' "$(fmt_t "$NOW")")  $1"
  shift
  for l in "$@"; do say "          $l"; done
}

start_session() {
  setsid psql -X -q -o /dev/null -d "$IDEM_PG_URL" -f "$WORK/session$1.sql" \
    >"$LOGS/session$1.log" 2>&1 </dev/null &
  EPID[$1]=$!
}
start_session 1
start_session 2
event "workload sessions 1 and 2 started (phase 1: ${PHASE1_TICKS%?}.${PHASE1_TICKS: -1} s)"

# check_procs: a relay or consumer that died is restarted; a death the demo did not plan is
# recorded (it fails the audit).
check_procs() {
  local name pid rc
  for name in "${PROCS[@]}"; do
    pid=${PID[$name]:-}
    [ -n "$pid" ] || continue
    alive "$pid" && continue
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    PID[$name]=""
    if [ -n "${FAULT[$name]}" ] && [ "$rc" = 137 ]; then
      case $name in
        relay*) event "${YEL}$name died at ${FAULT[$name]%%:*}${RST}: a batch confirmed by RabbitMQ but not marked sent" \
          "will be published again; $name restarted" ;;
        *) event "${YEL}$name died at ${FAULT[$name]%%:*}${RST}: a batch committed but not acked" \
          "will be redelivered; $name restarted" ;;
      esac
    else
      UNEXPECTED+=("$name instance ${INST[$name]} exited with status $rc (see $LOGS/$name.log)")
      event "${RED}$name exited unexpectedly with status $rc${RST}; $name restarted"
    fi
    retire_metrics "$name"
    start_proc "$name"
  done
}

kill_proc() {
  local name=$1 pid=${PID[$1]}
  scrape "$name"
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  PID[$name]=""
  retire_metrics "$name"
  event "${YEL}SIGKILL $name${RST} (pid $pid): $2"
}

STATS=""
# Payment failures of the recovering subscriptions not consumed yet (phase 2 waits for 0).
RECOV_LEFT_SQL="(SELECT count(*) FROM (SELECT DISTINCT o.invoice_id, o.attempt_no FROM demo.ops o
              JOIN invoices i USING (invoice_id) JOIN demo.subs s USING (subscription_id)
              WHERE s.story = 'recovering' AND o.kind = 'fail') f
             WHERE NOT EXISTS (SELECT 1 FROM consumed_events c WHERE c.consumer = '$CONSUMER'
               AND c.event_id = md5(f.invoice_id || ':failed:' || f.attempt_no)::uuid))"
# One psql session kept open for the progress queries (a new connection per tick costs more
# than the query on a busy 2-core machine); q SQL sets R to the result, on one line.
PQ_ALIVE=""
q() {
  local line
  R=""
  if [ -z "$PQ_ALIVE" ] || ! alive "$PQ_ALIVE"; then
    coproc PQ { exec setsid psql -X -A -t -q -F ' ' -d "$IDEM_PG_URL" 2>>"$LOGS/progress.log"; }
    PQ_ALIVE=$PQ_PID
  fi
  if printf '%s\n\\echo __END__\n' "$1" >&"${PQ[1]}"; then
    while IFS= read -r -t 5 -u "${PQ[0]}" line; do
      [ "$line" = __END__ ] && return 0
      R+="$line"
    done
  fi
  # No answer in time: drop the session (a late answer would be read as the next one's).
  kill -TERM "$PQ_ALIVE" 2>/dev/null || true
  PQ_ALIVE=""
  return 1
}

read_stats() {
  # emitted pending sent failed total business consumed recovering_left
  STATS=""
  q "
    SELECT (SELECT coalesce(sum(ops), 0) FROM demo.progress),
           count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'sent'),
           count(*) FILTER (WHERE status = 'failed'), count(*),
           count(*) FILTER (WHERE event_type IN ('invoice.paid', 'payment.failed')),
           (SELECT count(*) FROM consumed_events WHERE consumer = '$CONSUMER'),
           $RECOV_LEFT_SQL
    FROM event_outbox;" && STATS=$R
  if [[ "$STATS" =~ ^[0-9]+( [0-9]+){7}$ ]]; then
    read -r S_EMITTED S_PENDING S_SENT S_FAILED S_TOTAL S_BIZ S_CONSUMED S_RECOV_LEFT <<<"$STATS"
  else
    STATS=""
  fi
  return 0
}
S_EMITTED=0 S_PENDING=0 S_SENT=0 S_FAILED=0 S_TOTAL=0 S_BIZ=0 S_CONSUMED=0 S_RECOV_LEFT=1

COLS=$( (tput cols 2>/dev/null || echo 100) | tail -1)
LAST_PRINT=-100
show_progress() {
  local dups collapsed line
  collapsed=$((S_EMITTED - S_BIZ))
  [ "$collapsed" -ge 0 ] || collapsed=0
  dups=$((collapsed + $(metric_total D)))
  line=$(printf '  %6s  emitted %d/%d | pending %d | published %d | consumed %d | dups %d | dead %d' \
    "$(fmt_t "$NOW")" "$S_EMITTED" "$N_OPS" "$S_PENDING" "$S_SENT" "$S_CONSUMED" "$dups" \
    "$(metric_total DL)")
  if [ "$TTY" = 1 ] && [ ${#line} -ge "$COLS" ]; then # narrow terminal: the compact form
    line=${line//|/}
    line=${line//  / }
    line=${line#"${line%%[! ]*}"}
  fi
  if [ "$TTY" = 1 ]; then
    printf '\r\e[K%s' "${line:0:$((COLS - 1))}"
    PROGRESS_SHOWN=1
  elif [ $((NOW - LAST_PRINT)) -ge 20 ]; then
    printf '%s\n' "$line"
    LAST_PRINT=$NOW
  fi
}

DONE_KILL_RELAY=0 DONE_RESTART_RELAY=0 DONE_KILL_CONSUMER=0 DONE_RESTART_CONSUMER=0 PHASE2=0
DRAINING=0 STABLE=0 LAST_SIG="" T_DRAIN_START=0
while :; do
  update_now
  TICK_START_US=$((${EPOCHREALTIME//[!0-9]/} - T0_US))
  [ -z "${IDEM_DEMO_DEBUG:-}" ] || echo "tick start $NOW" >>"$LOGS/ticks.log"
  check_procs

  if [ "$DONE_KILL_RELAY" = 0 ] && [ "$NOW" -ge "$T_KILL_RELAY" ]; then
    kill_proc relay1 "its open transaction rolls back; relay2 carries on"
    DONE_KILL_RELAY=1
  fi
  if [ "$DONE_RESTART_RELAY" = 0 ] && [ "$NOW" -ge "$T_RESTART_RELAY" ]; then
    start_proc relay1 "$RELAY_FAULT"
    event "relay1 restarted with IDEM_FAULT=$RELAY_FAULT (dies after confirmed batch #${RELAY_FAULT##*:})"
    DONE_RESTART_RELAY=1
  fi
  if [ "$DONE_KILL_CONSUMER" = 0 ] && [ "$NOW" -ge "$T_KILL_CONSUMER" ]; then
    kill_proc consumer2 "its unacked deliveries return to the queue"
    DONE_KILL_CONSUMER=1
  fi
  if [ "$DONE_RESTART_CONSUMER" = 0 ] && [ "$NOW" -ge "$T_RESTART_CONSUMER" ]; then
    start_proc consumer2 "$CONSUMER_FAULT"
    event "consumer2 restarted with IDEM_FAULT=$CONSUMER_FAULT (dies after commit #${CONSUMER_FAULT##*:})"
    DONE_RESTART_CONSUMER=1
  fi

  for name in consumer1 consumer2; do scrape "$name"; done
  read_stats

  if [ "$PHASE2" = 0 ] && [ "$NOW" -ge "$T_PHASE2_EARLIEST" ] && [ -n "$STATS" ] && [ "$S_RECOV_LEFT" = 0 ]; then
    start_session 3
    PHASE2=1
    RECOV_LEFT_SQL=0
    event "phase 2: every payment failure of the $RECOVERING_SUBS 'recovering' subscriptions is consumed;" \
      "now they pay (session 3)"
  fi

  # Workload sessions: an error in a business transaction stops the demo.
  for s in 1 2 3; do
    pid=${EPID[$s]:-}
    [ -n "$pid" ] || continue
    alive "$pid" && continue
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    EPID[$s]=""
    [ "$rc" = 0 ] || die "workload session $s failed (psql status $rc):
$(tail -5 "$LOGS/session$s.log")"
    event "workload session $s finished"
  done

  if [ "$DRAINING" = 0 ] && [ "$PHASE2" = 1 ] && [ -z "${EPID[1]:-}${EPID[2]:-}${EPID[3]:-}" ]; then
    DRAINING=1
    T_DRAIN_START=$NOW
    event "all $N_OPS transactions committed; waiting for the outbox and the queue to drain"
  fi
  if [ "$DRAINING" = 0 ] && [ "$NOW" -ge $((PHASE1_TICKS + 200)) ]; then
    FAILED_RUN=1
    die "the workload did not finish within $(fmt_t $((PHASE1_TICKS + 200))) (phase 2 started: $PHASE2; $S_RECOV_LEFT recovering failures not consumed)"
  fi

  if [ "$DRAINING" = 1 ] && [ -n "$STATS" ]; then
    # Drained: nothing pending, one ledger row per event, nothing ready in the queue, and the
    # consumers' counters still for a second.
    sig="$S_TOTAL $S_CONSUMED $(metric_total A) $(metric_total D) $(metric_total DL)"
    if [ "$S_PENDING" = 0 ] && [ "$S_CONSUMED" = "$S_TOTAL" ] && [ "$sig" = "$LAST_SIG" ] &&
      [ "$(queue_depths)" = "0 0" ]; then
      STABLE=$((STABLE + 1))
    else
      STABLE=0
    fi
    LAST_SIG=$sig
    if [ "$STABLE" -ge 2 ]; then
      show_progress
      [ "$TTY" = 1 ] && printf '\n' && PROGRESS_SHOWN=0
      event "drained in $(fmt_t $((NOW - T_DRAIN_START))) after the last emit"
      break
    fi
    if [ $((NOW - T_DRAIN_START)) -ge $((DRAIN_TIMEOUT_S * 10)) ]; then
      show_progress
      FAILED_RUN=1
      say ""
      say "${RED}FAIL: not drained ${DRAIN_TIMEOUT_S} s after the last emit${RST}: pending $S_PENDING, failed $S_FAILED, events $S_TOTAL, ledger rows $S_CONSUMED, queue/dlq ready: $(queue_depths)"
      "$IDEM" status >"$LOGS/status.txt" 2>&1 || true
      sed 's/^/      /' "$LOGS/status.txt"
      for name in "${PROCS[@]}"; do
        say "---- last lines of $LOGS/$name.log"
        tail -5 "$LOGS/$name.log"
      done
      exit 1
    fi
  fi

  show_progress
  # Next tick 0.5 s after this one started (the work above takes part of it).
  t_us=$((${EPOCHREALTIME//[!0-9]/} - T0_US))
  [ -z "${IDEM_DEMO_DEBUG:-}" ] || echo "tick end $((t_us / 100000))" >>"$LOGS/ticks.log"
  wait_us=$((TICK_START_US + 500000 - t_us))
  [ "$wait_us" -lt 50000 ] && wait_us=50000
  sleep "$((wait_us / 1000000)).$(printf '%06d' $((wait_us % 1000000)))"
done

# ----------------------------------------------------------------------------------- shutdown

step "[5/5] Stopping relays and consumers with SIGTERM, then auditing"
for name in consumer1 consumer2; do scrape "$name"; done
for name in "${PROCS[@]}"; do [ -z "${PID[$name]}" ] || kill -TERM "${PID[$name]}" 2>/dev/null || true; done
for name in "${PROCS[@]}"; do
  pid=${PID[$name]}
  [ -n "$pid" ] || continue
  n=100
  while alive "$pid" && [ "$n" -gt 0 ]; do
    sleep 0.1
    n=$((n - 1))
  done
  if alive "$pid"; then
    UNEXPECTED+=("$name did not exit within 10 s of SIGTERM (see $LOGS/$name.log)")
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rc=0
  wait "$pid" 2>/dev/null || rc=$?
  PID[$name]=""
  [ "$rc" = 0 ] || { [ "$rc" = 137 ] && [ -n "${FAULT[$name]}" ]; } || UNEXPECTED+=("$name exited with status $rc on SIGTERM (see $LOGS/$name.log)")
done

# Anything still unacked went back to the queue when the consumers disconnected.
depths=""
for _ in 1 2 3 4 5; do
  depths=$(queue_depths) || depths="? ?"
  [ "$depths" = "0 0" ] && break
  sleep 0.3
done
read -r Q_READY Q_DLQ <<<"$depths"

# --------------------------------------------------------------------------------- the report

read_stats
TOTAL_D=$(metric_total D) TOTAL_DL=$(metric_total DL)
COLLAPSED=$((S_EMITTED - S_BIZ))
read -r E_PF E_IP E_RR < <(psqlq -A -t -F ' ' -c "
  SELECT count(*) FILTER (WHERE event_type = 'payment.failed'),
         count(*) FILTER (WHERE event_type = 'invoice.paid'),
         count(*) FILTER (WHERE event_type = 'receipt.requested') FROM event_outbox")
AUDIT=$(psqlq -A -t -F $'\t' -v consumer="$CONSUMER" -f "$DEMO/audit.sql" 2>>"$LOGS/audit.log") ||
  die "the audit query failed; see $LOGS/audit.log"

num() { printf '%6d' "$1"; }
say ""
say "${B}Closing report${RST}"
say "  emitted                $(num "$S_EMITTED")  business transactions: $N_DISTINCT operations + $N_REPLAYS replays"
say "  events in the outbox   $(num "$S_TOTAL")  $E_PF payment.failed, $E_IP invoice.paid,"
say "                                 $E_RR receipt.requested (emitted by the invoice.paid handler)"
say "  published              $(num "$S_SENT")  outbox rows sent, confirmed by RabbitMQ"
say "  consumed               $(num "$S_CONSUMED")  ledger rows: events applied"
say "  duplicates suppressed  $(num $((COLLAPSED + TOTAL_D)))  $COLLAPSED replays collapsed in the outbox,"
say "                                 at least $TOTAL_D redelivered messages skipped by the ledger"
say "  dead-lettered          $(num "$TOTAL_DL")  the dead-letter queue holds $Q_DLQ messages"
say "  faults injected                relay1: SIGKILL, then a crash at ${RELAY_FAULT%%:*}"
say "                                 consumer2: SIGKILL, then a crash at ${CONSUMER_FAULT%%:*}"
say ""
say "${B}Audit${RST}"
FAILS=0
verdict() { # verdict OK TEXT DETAIL
  if [ "$1" = t ]; then
    say "  ${GRN}PASS${RST}  $2"
  else
    say "  ${RED}FAIL${RST}  $2"
    FAILS=$((FAILS + 1))
  fi
  [ -z "${3:-}" ] || say "        ${DIM}$3${RST}"
}
while IFS=$'\t' read -r _ ok text detail; do
  verdict "$ok" "$text" "$detail"
done <<<"$AUDIT"
ok=f
[ "$Q_READY" = 0 ] && [ "$Q_DLQ" = 0 ] && [ "$TOTAL_DL" = 0 ] && ok=t
verdict "$ok" "broker: $QUEUE drained, nothing dead-lettered" "$Q_READY messages left in $QUEUE, $Q_DLQ in $QUEUE.dlq; consumers dead-lettered $TOTAL_DL"
ok=f
[ ${#UNEXPECTED[@]} -eq 0 ] && ok=t
verdict "$ok" "processes: no unplanned exits; all stopped cleanly on SIGTERM" \
  "$(if [ "$ok" = t ]; then echo "relay1: ${INST[relay1]} instances, relay2: ${INST[relay2]}, consumer1: ${INST[consumer1]}, consumer2: ${INST[consumer2]}"; else printf '%s; ' "${UNEXPECTED[@]}"; fi)"

say ""
if [ "$FAILS" -eq 0 ]; then
  say "${GRN}${B}PASS${RST}: every event took effect exactly once ($((SECONDS - T_START)) s)."
  exit 0
fi
FAILED_RUN=1
say "${RED}${B}FAIL${RST}: $FAILS audit line(s) failed; logs: $LOGS"
exit 1
