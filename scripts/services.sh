#!/usr/bin/env bash
# Private PostgreSQL 15 + RabbitMQ instances for idem's tests and for local runs.
#
#   services.sh start DIR [--durable]   start both under DIR; prints DIR/env.sh (only that, on stdout)
#   services.sh stop DIR                stop both, then epmd; leaves no process behind (idempotent)
#   services.sh pg-stop|pg-start DIR    stop/start PostgreSQL only, same data and port
#   services.sh rmq-stop|rmq-start DIR  stop/start RabbitMQ only, same data and ports
#   services.sh rmqctl DIR ARGS...      rabbitmqctl against this instance
#   services.sh with DIR|- [--durable] -- CMD...
#                                       start (in a fresh temp dir for "-"), source env.sh, run CMD,
#                                       always stop afterwards; exit status is CMD's
#
# Every instance has its own ports (free loopback ports picked at start, or IDEM_PG_PORT /
# IDEM_AMQP_PORT), its own epmd on a private ERL_EPMD_PORT, node name and cookie, so several
# instances can run side by side. Without --durable PostgreSQL runs with fsync, synchronous_commit
# and full_page_writes off (throw-away data). Logs go to stderr and to files under DIR.
# Set IDEM_SVC_KEEP=1 to keep the temporary directory of `with -` (logs) after the run.
set -euo pipefail

PGBIN=/usr/lib/postgresql/15/bin
RMQBIN=/usr/lib/rabbitmq/bin
EPMD=/usr/bin/epmd
PY=/usr/bin/python3
ME=$(readlink -f "${BASH_SOURCE[0]}")

log() { printf 'services: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
usage() {
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$ME" >&2
  exit 2
}

# ---------------------------------------------------------------- process helpers

# alive PID: the process exists and is not a zombie (PID 1 reaps orphans lazily here).
alive() {
  local pid=$1 st
  [ -n "$pid" ] && [ -r "/proc/$pid/status" ] || return 1
  st=$(awk '/^State:/{print $2; exit}' "/proc/$pid/status" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

readpid() { [ -s "$1" ] && cat "$1" 2>/dev/null || true; }

# wait_gone PID SECONDS: poll until the process is gone; 1 if still there.
wait_gone() {
  local pid=$1 n=$(($2 * 20))
  while alive "$pid"; do
    [ "$n" -gt 0 ] || return 1
    n=$((n - 1))
    sleep 0.05
  done
}

# stop_pid PID NAME SECONDS: TERM, wait, then KILL.
stop_pid() {
  local pid=$1 name=$2 secs=${3:-10}
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  wait_gone "$pid" "$secs" && return 0
  log "$name (pid $pid) ignored SIGTERM for ${secs}s, killing it"
  kill -KILL "$pid" 2>/dev/null || true
  wait_gone "$pid" 5 || log "warning: $name (pid $pid) survived SIGKILL"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# pick_ports N: N distinct free loopback ports (bind test on 127.0.0.1 and ::1) from a range below
# the ephemeral one, in random order so that concurrent instances rarely race for one.
pick_ports() {
  "$PY" - "$1" <<'PYEOF'
import random, socket, sys
n = int(sys.argv[1])
def free(p):
    for fam, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.bind((addr, p))
        except OSError as e:
            if fam == socket.AF_INET6 and e.errno == 99:  # no IPv6 loopback: fine
                continue
            return False
        finally:
            s.close()
    return True
got = []
cands = list(range(20000, 32000))
random.shuffle(cands)
for p in cands:
    if p not in got and free(p):
        got.append(p)
        if len(got) == n:
            break
print(" ".join(map(str, got)))
PYEOF
}

port_free() {
  "$PY" -c 'import socket,sys
s=socket.socket()
try: s.bind(("127.0.0.1",int(sys.argv[1])))
except OSError: sys.exit(1)' "$1"
}

# ---------------------------------------------------------------- instance state

# set_dir DIR: absolute path, state file names.
set_dir() {
  [ -n "${1:-}" ] || usage
  D=$(realpath -m -- "$1")
  case "$D" in /) die "refusing to use / as the services directory" ;; esac
  STATE=$D/state.sh
  R=$D/rmq
  P=$D/pg
}

load_state() {
  [ -f "$STATE" ] || die "no instance in $D (run: services.sh start $D)"
  # shellcheck disable=SC1090
  . "$STATE"
}

# The same environment for the server and every CLI call (node name, cookie via HOME, ports).
rmq_env() {
  export HOME=$R/home RABBITMQ_NODENAME=$NODENAME RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT=$AMQP_PORT RABBITMQ_DIST_PORT=$DIST_PORT \
    RABBITMQ_CTL_DIST_PORT_MIN=$CTL_MIN RABBITMQ_CTL_DIST_PORT_MAX=$CTL_MAX \
    ERL_EPMD_PORT=$EPMD_PORT ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' \
    RABBITMQ_CTL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' \
    RABBITMQ_CONF_ENV_FILE=$R/rabbitmq-env.conf RABBITMQ_CONFIG_FILE=$R/rabbitmq.conf \
    RABBITMQ_ADVANCED_CONFIG_FILE=$R/advanced.config RABBITMQ_ENABLED_PLUGINS_FILE=$R/enabled_plugins \
    RABBITMQ_MNESIA_BASE=$R/mnesia RABBITMQ_LOG_BASE=$R/log RABBITMQ_PID_FILE=$R/rabbit.pid
}

rmqctl() { (rmq_env && cd "$R" && exec "$RMQBIN/rabbitmqctl" "$@"); }

# ---------------------------------------------------------------- PostgreSQL

pg_logtail() {
  local f
  for f in "$P/initdb.log" "$P/pg_ctl.log" "$P/server.log"; do
    [ -s "$f" ] || continue
    printf -- '--- %s (tail)\n' "$f" >&2
    tail -n 30 "$f" >&2
  done
}

pg_init() {
  mkdir -p "$P/sock"
  chown postgres: "$P" "$P/sock"
  install -d -m 700 -o postgres -g postgres "$P/data"
  local nosync=()
  [ "$DURABLE" = 1 ] || nosync=(-N)
  # cd: postgres needs a cwd it can read.
  if ! (cd "$P" && exec runuser -u postgres -- "$PGBIN/initdb" -D "$P/data" -U postgres -A trust \
    -E UTF8 --locale=C "${nosync[@]}") >"$P/initdb.log" 2>&1 </dev/null; then
    pg_logtail
    die "initdb failed in $P/data"
  fi
  {
    echo "# idem private instance"
    echo "port = $PG_PORT"
    echo "listen_addresses = '127.0.0.1'"
    echo "unix_socket_directories = '$P/sock'"
    echo "max_connections = 200"
    if [ "$DURABLE" != 1 ]; then
      echo "fsync = off"
      echo "synchronous_commit = off"
      echo "full_page_writes = off"
    fi
  } >>"$P/data/postgresql.conf"
}

pg_running() { alive "$(head -n1 "$P/data/postmaster.pid" 2>/dev/null || true)"; }

pg_start() {
  if pg_running; then
    log "PostgreSQL already running on 127.0.0.1:$PG_PORT"
    return 0
  fi
  if ! (cd "$P" && exec runuser -u postgres -- "$PGBIN/pg_ctl" -D "$P/data" -l "$P/server.log" \
    -w -t 90 start) >"$P/pg_ctl.log" 2>&1 </dev/null; then
    pg_logtail
    die "PostgreSQL did not start on 127.0.0.1:$PG_PORT"
  fi
  local n=200
  until "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -t 2; do
    n=$((n - 1))
    if [ "$n" -le 0 ]; then
      pg_logtail
      die "PostgreSQL not ready on 127.0.0.1:$PG_PORT"
    fi
    sleep 0.05
  done
}

pg_createdb() {
  local have
  have=$("$PGBIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Atc \
    "select 1 from pg_database where datname = 'idem'") || {
    pg_logtail
    die "cannot query PostgreSQL on 127.0.0.1:$PG_PORT"
  }
  [ "$have" = 1 ] && return 0
  "$PGBIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres idem || die "createdb idem failed"
}

pg_stop() {
  [ -d "$P/data" ] || return 0
  local pid
  pid=$(head -n1 "$P/data/postmaster.pid" 2>/dev/null || true)
  alive "$pid" || return 0
  (cd "$P" && exec runuser -u postgres -- "$PGBIN/pg_ctl" -D "$P/data" -m fast -w -t 30 stop) \
    >>"$P/pg_ctl.log" 2>&1 </dev/null || true
  if alive "$pid"; then
    log "pg_ctl stop did not stop PostgreSQL (pid $pid); sending SIGQUIT"
    kill -QUIT "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
  fi
  wait_gone "$pid" 5 || true
}

# ---------------------------------------------------------------- RabbitMQ

rmq_logtail() {
  local f
  # Most telling last: a boot that fails early (bad config) only writes to stdout.log.
  for f in "$R/log/epmd.log" "$R/log/$NODENAME.log" "$R/log/wait.log" "$R/log/stdout.log"; do
    [ -s "$f" ] || continue
    printf -- '--- %s (tail)\n' "$f" >&2
    tail -n 25 "$f" >&2
  done
}

rmq_init() {
  mkdir -p "$R/home" "$R/mnesia" "$R/log"
  chmod 700 "$R/home"
  # A private HOME gives a private cookie; create it first so that server and CLI agree.
  od -An -N20 -tu1 /dev/urandom | awk '{for(i=1;i<=NF;i++) printf "%c",65+$i%26}' >"$R/home/.erlang.cookie"
  chmod 400 "$R/home/.erlang.cookie"
  : >"$R/rabbitmq-env.conf" # shadows /etc/rabbitmq/rabbitmq-env.conf
  echo '[].' >"$R/enabled_plugins"
  printf 'listeners.tcp.default = 127.0.0.1:%s\nloopback_users.guest = true\nlog.file.level = info\nlog.console = false\n' \
    "$AMQP_PORT" >"$R/rabbitmq.conf"
}

epmd_start() {
  alive "$(readpid "$R/epmd.pid")" && return 0
  # Foreground epmd in its own session: we own its PID and terminal Ctrl-C does not reach it.
  (rmq_env && cd "$R" && exec setsid "$EPMD" -port "$EPMD_PORT" -address 127.0.0.1) \
    >>"$R/log/epmd.log" 2>&1 </dev/null &
  echo $! >"$R/epmd.pid"
  local n=200
  until port_open "$EPMD_PORT"; do
    if ! alive "$(readpid "$R/epmd.pid")" || [ "$n" -le 0 ]; then
      rmq_logtail
      die "epmd did not start on 127.0.0.1:$EPMD_PORT"
    fi
    n=$((n - 1))
    sleep 0.05
  done
}

rmq_running() { alive "$(readpid "$R/beam.pid")"; }

rmq_start() {
  if rmq_running; then
    log "RabbitMQ already running on 127.0.0.1:$AMQP_PORT"
    return 0
  fi
  epmd_start
  rm -f "$R/rabbit.pid" "$R/beam.pid"
  (rmq_env && cd "$R" && exec setsid "$RMQBIN/rabbitmq-server") >>"$R/log/stdout.log" 2>&1 </dev/null &
  local launcher=$! n=1200 beam=""
  echo "$launcher" >"$R/launcher.pid"
  while :; do
    beam=$(readpid "$R/rabbit.pid")
    [ -n "$beam" ] && break
    if ! alive "$launcher" || [ "$n" -le 0 ]; then
      rmq_logtail
      die "RabbitMQ did not start (launcher exited or no pid file after 60 s)"
    fi
    n=$((n - 1))
    sleep 0.05
  done
  # The pid file disappears early in shutdown: keep our own copy to wait on.
  echo "$beam" >"$R/beam.pid"
  # In the background: bash runs a trap only once a foreground child is done, and this takes seconds.
  rmqctl -q wait --pid "$beam" --timeout 90 >"$R/log/wait.log" 2>&1 </dev/null &
  if ! wait $!; then
    rmq_logtail
    die "RabbitMQ node $NODENAME not ready on 127.0.0.1:$AMQP_PORT"
  fi
  port_open "$AMQP_PORT" || {
    rmq_logtail
    die "RabbitMQ ready but nothing listens on 127.0.0.1:$AMQP_PORT"
  }
}

rmq_stop() {
  local beam launcher
  beam=$(readpid "$R/beam.pid")
  launcher=$(readpid "$R/launcher.pid")
  # SIGTERM to beam is a graceful shutdown (and runs no CLI, which would respawn epmd).
  stop_pid "$beam" "RabbitMQ beam" 30
  stop_pid "$launcher" "RabbitMQ launcher" 5
  rm -f "$R/beam.pid" "$R/launcher.pid"
}

epmd_stop() {
  stop_pid "$(readpid "$R/epmd.pid")" epmd 5
  rm -f "$R/epmd.pid"
}

# ---------------------------------------------------------------- leftovers

# Processes that belong to the instance in D: server binaries (postgres, erlang, epmd, the sh
# launcher) whose cwd is under D, whose command line names a path under D, or whose environment
# points into D (CLI-spawned `epmd -daemon` inherits HOME=$R/home). Our own ancestors are skipped.
leftovers() {
  local skip=" " pid=$$ p exe cwd
  while [ -n "$pid" ] && [ "$pid" -gt 1 ]; do
    skip="$skip$pid "
    pid=$(awk '/^PPid:/{print $2; exit}' "/proc/$pid/status" 2>/dev/null || true)
  done
  skip="$skip$BASHPID "
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    case "$skip" in *" $pid "*) continue ;; esac
    exe=$(readlink "$p/exe" 2>/dev/null || true)
    case "$exe" in
      /usr/lib/postgresql/* | /usr/lib/erlang/* | */epmd | /usr/bin/dash | /bin/dash) ;;
      *) continue ;;
    esac
    alive "$pid" || continue
    cwd=$(readlink "$p/cwd" 2>/dev/null || true)
    if [[ "$cwd" == "$D" || "$cwd" == "$D"/* ]] ||
      tr '\0' '\n' <"$p/cmdline" 2>/dev/null | grep -qF -- "$D/" ||
      tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF -- "HOME=$R/home"; then
      echo "$pid"
    fi
  done
}

reap_leftovers() {
  local pids pid
  pids=$(leftovers)
  [ -n "$pids" ] || return 0
  for pid in $pids; do
    log "leftover process $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120); terminating"
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $pids; do wait_gone "$pid" 3 || kill -KILL "$pid" 2>/dev/null || true; done
  for pid in $pids; do wait_gone "$pid" 3 || log "warning: process $pid still running"; done
}

# ---------------------------------------------------------------- commands

write_env() {
  cat >"$D/env.sh.tmp" <<EOF
export IDEM_PG_URL=postgresql://postgres@127.0.0.1:$PG_PORT/idem IDEM_AMQP_URL=amqp://guest:guest@127.0.0.1:$AMQP_PORT IDEM_SVC_DIR=$D IDEM_PG_PORT=$PG_PORT IDEM_AMQP_PORT=$AMQP_PORT
EOF
  mv "$D/env.sh.tmp" "$D/env.sh"
}

cmd_start() {
  set_dir "${1:-}"
  shift
  local durable=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --durable) durable=1 ;;
      *) usage ;;
    esac
    shift
  done
  local t0=$SECONDS
  mkdir -p "$D"
  chmod 755 "$D"
  runuser -u postgres -- test -x "$D" ||
    die "user postgres cannot reach $D (every parent directory must be traversable; use /tmp)"

  if [ -f "$STATE" ]; then
    load_state
    [ "$durable" = "$DURABLE" ] || log "note: $D was created with DURABLE=$DURABLE; keeping that"
    log "reusing instance in $D (PostgreSQL $PG_PORT, RabbitMQ $AMQP_PORT)"
  else
    local ports
    read -r -a ports <<<"$(pick_ports 5)"
    [ ${#ports[@]} -eq 5 ] || die "could not find free loopback ports"
    PG_PORT=${IDEM_PG_PORT:-${ports[0]}}
    AMQP_PORT=${IDEM_AMQP_PORT:-${ports[1]}}
    DIST_PORT=${ports[2]}
    EPMD_PORT=${ports[3]}
    # The CLI takes any free port in its range; a private range just avoids needless sharing.
    CTL_MIN=${ports[4]}
    CTL_MAX=$((CTL_MIN + 9))
    port_free "$PG_PORT" || die "port $PG_PORT on 127.0.0.1 is in use${IDEM_PG_PORT:+ (IDEM_PG_PORT)}"
    port_free "$AMQP_PORT" || die "port $AMQP_PORT on 127.0.0.1 is in use${IDEM_AMQP_PORT:+ (IDEM_AMQP_PORT)}"
    NODENAME="idem-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')@localhost"
    DURABLE=$durable
    cat >"$STATE" <<EOF
PG_PORT=$PG_PORT
AMQP_PORT=$AMQP_PORT
DIST_PORT=$DIST_PORT
EPMD_PORT=$EPMD_PORT
CTL_MIN=$CTL_MIN
CTL_MAX=$CTL_MAX
NODENAME=$NODENAME
DURABLE=$DURABLE
EOF
    rmq_init
    mkdir -p "$P"
  fi

  # On any failure or interruption from here on, stop whatever did start.
  START_PGJOB=""
  trap 'start_failed' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  # Both servers at once: PostgreSQL is ready in ~1 s, RabbitMQ in 5-10 s (CPU-bound boot).
  (
    [ -f "$P/data/PG_VERSION" ] || pg_init
    pg_start
    pg_createdb
  ) &
  START_PGJOB=$!
  rmq_start
  wait "$START_PGJOB" || exit 1
  START_PGJOB=""
  write_env
  trap - EXIT INT TERM
  log "PostgreSQL 127.0.0.1:$PG_PORT, RabbitMQ 127.0.0.1:$AMQP_PORT ($NODENAME, epmd $EPMD_PORT)$([ "$DURABLE" = 1 ] && echo ', durable') up in $((SECONDS - t0)) s"
  echo "$D/env.sh"
}

start_failed() {
  local rc=$?
  trap - EXIT
  trap '' INT TERM
  [ "$rc" = 0 ] && return 0
  log "start failed; stopping what did start in $D"
  [ -n "${START_PGJOB:-}" ] && wait "$START_PGJOB" 2>/dev/null
  do_stop
  exit "$rc"
}

do_stop() {
  if [ -f "$STATE" ]; then
    . "$STATE"
    pg_stop &
    local pgjob=$!
    rmq_stop
    wait "$pgjob" || true
    epmd_stop # last: any CLI call would start it again
  fi
  reap_leftovers
}

cmd_stop() {
  set_dir "${1:-}"
  [ -d "$D" ] || return 0
  do_stop
  log "stopped $D"
}

cmd_pg() {
  set_dir "${2:-}"
  load_state
  case "$1" in
    start) pg_start ;;
    stop) pg_stop ;;
  esac
}

cmd_rmq() {
  set_dir "${2:-}"
  load_state
  case "$1" in
    start) rmq_start ;;
    stop) rmq_stop ;;
  esac
}

cmd_rmqctl() {
  set_dir "${1:-}"
  shift
  load_state
  rmq_running || die "RabbitMQ of $D is not running"
  rmqctl "$@"
}

cmd_with() {
  local dir=${1:-} durable=()
  [ -n "$dir" ] || usage
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    case "$1" in
      --durable) durable=(--durable) ;;
      *) usage ;;
    esac
    shift
  done
  [ "${1:-}" = -- ] || usage
  shift
  [ $# -gt 0 ] || usage

  local tmp=0
  if [ "$dir" = - ]; then
    dir=$(mktemp -d /tmp/idem-svc.XXXXXX)
    tmp=1
  fi
  WITH_DIR=$(realpath -m -- "$dir")
  WITH_TMP=$tmp
  WITH_CHILD=""
  trap 'with_cleanup' EXIT
  trap 'with_signal INT 130' INT
  trap 'with_signal TERM 143' TERM
  trap 'with_signal HUP 129' HUP

  # Both in the background so that a signal to this script is handled at once (bash runs a trap
  # only after a foreground child is done). start cleans up after itself when signalled.
  "$ME" start "$WITH_DIR" "${durable[@]}" >/dev/null </dev/null &
  WITH_CHILD=$!
  wait "$WITH_CHILD" || exit 1
  WITH_CHILD=""
  # shellcheck disable=SC1090,SC1091
  . "$WITH_DIR/env.sh"

  # SIGINT back to default: bash makes async children ignore it, and Ctrl-C must reach CMD.
  # Keep our stdin for CMD (async commands get /dev/null), unless there is none (CI).
  if { : <&0; } 2>/dev/null; then
    env --default-signal=INT "$@" <&0 &
  else
    env --default-signal=INT "$@" </dev/null &
  fi
  WITH_CHILD=$!
  local rc=0
  wait "$WITH_CHILD" || rc=$?
  WITH_CHILD=""
  exit "$rc"
}

with_signal() {
  local sig=$1 code=$2
  trap '' INT TERM HUP
  log "got SIG$sig; stopping the command and the servers"
  if [ -n "${WITH_CHILD:-}" ] && alive "$WITH_CHILD"; then
    kill -TERM "$WITH_CHILD" 2>/dev/null || true
    local n=400
    while alive "$WITH_CHILD" && [ $n -gt 0 ]; do
      n=$((n - 1))
      sleep 0.05
    done
    alive "$WITH_CHILD" && kill -KILL "$WITH_CHILD" 2>/dev/null || true
  fi
  exit "$code"
}

with_cleanup() {
  local rc=$?
  trap '' INT TERM HUP
  trap - EXIT
  "$ME" stop "$WITH_DIR" || true
  if [ "$WITH_TMP" = 1 ]; then
    if [ "${IDEM_SVC_KEEP:-0}" = 1 ]; then
      log "kept $WITH_DIR"
    else
      rm -rf -- "$WITH_DIR"
    fi
  fi
  exit "$rc"
}

main() {
  [ $# -ge 1 ] || usage
  local cmd=$1
  shift
  [ "$(id -u)" -eq 0 ] || die "must run as root (PostgreSQL runs as user postgres via runuser)"
  case "$cmd" in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    pg-start) cmd_pg start "$@" ;;
    pg-stop) cmd_pg stop "$@" ;;
    rmq-start) cmd_rmq start "$@" ;;
    rmq-stop) cmd_rmq stop "$@" ;;
    rmqctl) cmd_rmqctl "$@" ;;
    with) cmd_with "$@" ;;
    -h | --help | help) usage ;;
    *) usage ;;
  esac
}

main "$@"
