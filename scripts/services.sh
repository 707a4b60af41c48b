#!/usr/bin/env bash
# Private PostgreSQL 15 + RabbitMQ instances for idem's tests and for local runs.
#
#   services.sh start DIR [OPTIONS]      start everything under DIR; prints DIR/env.sh (only that,
#                                        on stdout). Starting a stopped DIR again keeps the options
#                                        it was created with.
#   services.sh stop DIR                 stop every server, then epmd; leaves no process behind
#                                        (idempotent)
#   services.sh pg-stop DIR [--immediate] [--node N|--all]
#                                        stop PostgreSQL: the current primary (default) or server N
#                                        (1 = first primary, 2 = standby) or both; --immediate is
#                                        pg_ctl -m immediate (a crash: no shutdown checkpoint)
#   services.sh pg-start DIR [--node N]  start PostgreSQL, same data and ports: the primary and a
#                                        standby (default) or server N
#   services.sh pg-promote DIR           promote the standby (the primary must be stopped); it then
#                                        waits for no standby and accepts writes at once
#   services.sh pg-rejoin DIR            rebuild the server that is not the primary (e.g. the old
#                                        primary after pg-promote) as its synchronous standby
#   services.sh rmq-stop|rmq-start DIR [--node K]
#                                        stop/start RabbitMQ: every node (default) or node K only;
#                                        same data and ports
#   services.sh rmqctl DIR [--node K] ARGS...
#                                        rabbitmqctl against node K (default: the first one running)
#   services.sh rmq-leader DIR QUEUE     print the number K of the node that leads quorum QUEUE
#   services.sh with DIR|- [OPTIONS] -- CMD...
#                                        start (in a fresh temp dir for "-"), source env.sh, run CMD,
#                                        always stop afterwards; exit status is CMD's
#
# OPTIONS (start and with):
#   --durable          PostgreSQL with fsync, synchronous_commit and full_page_writes on; without
#                      it they are off (throw-away data)
#   --no-hash-plugin   leave rabbitmq_consistent_hash_exchange disabled (it is enabled by default:
#                      idem needs no plugin, an older idem's hash ring in the upgrade test does)
#   --rmq-nodes N      a RabbitMQ cluster of N nodes (1-9, default 1) on this machine: own node
#                      name, AMQP and dist port, data and logs each, one cookie and one private epmd;
#                      nodes 2..N join node 1. Quorum queues need a majority of the nodes up.
#   --pg-standby       a second PostgreSQL server (2) streaming from the primary (1) as its
#                      synchronous standby (synchronous_commit stays on, even without --durable):
#                      while the standby is down, commits on the primary wait for it
#   --tls              a private CA (openssl) and TLS listeners: amqps on every node (verify_peer,
#                      a client certificate optional), PostgreSQL ssl=on with a hostssl entry; the
#                      role idem_client must log in over TLS with the client certificate
#   --mtls             --tls, and RabbitMQ refuses TLS clients without a certificate
#                      (fail_if_no_peer_cert)
#   --tls-wrong-name   --tls, but both servers present a certificate for wrong.invalid (signed by
#                      the same CA): hostname verification of 127.0.0.1/localhost must fail
#
# env.sh exports IDEM_PG_URL, IDEM_AMQP_URL (node 1), IDEM_SVC_DIR, IDEM_PG_PORT, IDEM_AMQP_PORT,
# and IDEM_AMQP_URLS (every node, comma-separated), IDEM_RMQ_NODES, IDEM_AMQP_PORT_<K>,
# IDEM_RMQ_NODE_<K> (node names), IDEM_RMQ_HASH_PLUGIN (1/0);
# with --pg-standby: IDEM_PG_STANDBY_PORT, IDEM_PG_URL_HA (both hosts,
# target_session_attrs=read-write); with --tls: IDEM_TLS_DIR, IDEM_TLS_CA, IDEM_TLS_CLIENT_CERT,
# IDEM_TLS_CLIENT_KEY, IDEM_TLS_CLIENT_USER, IDEM_TLS_SERVER_CERT, IDEM_TLS_WRONG_CERT,
# IDEM_TLS_WRONG_KEY, IDEM_TLS_SERVER_NAME (the name the servers' certificate is for),
# IDEM_TLS_MUTUAL (1/0), IDEM_AMQPS_PORT, IDEM_AMQPS_PORT_<K>, IDEM_AMQPS_URL, IDEM_AMQPS_URLS
# (with cacertfile, plus certfile/keyfile under --mtls) and IDEM_PG_TLS_URL (sslmode=verify-full).
# The server certificate names localhost and 127.0.0.1 both as IP and as DNS name (librabbitmq
# 0.11 compares the host with DNS names only).
#
# Every instance has its own ports (free loopback ports picked at start, or IDEM_PG_PORT /
# IDEM_AMQP_PORT for server 1 and node 1), its own epmd on a private ERL_EPMD_PORT, node names
# and cookie, so several instances can run side by side (a start run under `with` inherits the
# IDEM_*_PORT of env.sh: unset them first). Logs go to stderr and to files under DIR.
# Set IDEM_SVC_KEEP=1 to keep the temporary directory of `with -` (logs) after the run.
set -euo pipefail

PGBIN=/usr/lib/postgresql/15/bin
RMQBIN=/usr/lib/rabbitmq/bin
EPMD=/usr/bin/epmd
PY=/usr/bin/python3
HASH_PLUGIN_NAME=rabbitmq_consistent_hash_exchange
TLS_CLIENT_USER=idem_client
TLS_WRONG_NAME=wrong.invalid
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

# shq VALUE: VALUE as one shell word (env.sh is sourced: & and ? in URLs must be quoted).
shq() {
  case $1 in
    *[!A-Za-z0-9_./:@,%+=-]*) printf "'%s'" "${1//\'/\'\\\'\'}" ;;
    *) printf '%s' "$1" ;;
  esac
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
  T=$D/tls
}

load_state() {
  [ -f "$STATE" ] || die "no instance in $D (run: services.sh start $D)"
  # shellcheck disable=SC1090
  . "$STATE"
  # An instance made before clusters, standbys and TLS: one node, its plugin file as it was.
  if [ -z "${RMQ_NODES:-}" ]; then
    RMQ_NODES=1 NODENAMES=("$NODENAME") AMQP_PORTS=("$AMQP_PORT") DIST_PORTS=("$DIST_PORT")
    AMQPS_PORTS=() PG2_PORT="" PG_STANDBY=0 TLS=0 TLS_MUTUAL=0 TLS_WRONG=0
    grep -qF "$HASH_PLUGIN_NAME" "$R/enabled_plugins" 2>/dev/null && HASH_PLUGIN=1 || HASH_PLUGIN=0
  fi
}

# node_select K: RabbitMQ node K (1-based) becomes the current one: its name, ports and directory
# (node 1 keeps the single-node layout, $R itself; node K > 1 lives in $R/nodeK).
node_select() {
  local i=$(($1 - 1))
  NODE=$1
  NODENAME=${NODENAMES[$i]}
  AMQP_PORT=${AMQP_PORTS[$i]}
  DIST_PORT=${DIST_PORTS[$i]}
  AMQPS_PORT=${AMQPS_PORTS[$i]:-}
  if [ "$1" = 1 ]; then RN=$R; else RN=$R/node$1; fi
}

# check_node K: K names a node of this instance.
check_node() {
  case "$1" in '' | *[!0-9]*) die "--node needs a node number (1-$RMQ_NODES)" ;; esac
  if [ "$1" -lt 1 ] || [ "$1" -gt "$RMQ_NODES" ]; then
    die "no RabbitMQ node $1 in $D (nodes 1-$RMQ_NODES)"
  fi
}

# The same environment for a node's server and every CLI call to it (node name, cookie via the
# shared HOME, ports). The enabled-plugins file and the cookie are shared by all nodes.
rmq_env() {
  export HOME=$R/home RABBITMQ_NODENAME=$NODENAME RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT=$AMQP_PORT RABBITMQ_DIST_PORT=$DIST_PORT \
    RABBITMQ_CTL_DIST_PORT_MIN=$CTL_MIN RABBITMQ_CTL_DIST_PORT_MAX=$CTL_MAX \
    ERL_EPMD_PORT=$EPMD_PORT ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' \
    RABBITMQ_CTL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' \
    RABBITMQ_CONF_ENV_FILE=$R/rabbitmq-env.conf RABBITMQ_CONFIG_FILE=$RN/rabbitmq.conf \
    RABBITMQ_ADVANCED_CONFIG_FILE=$RN/advanced.config RABBITMQ_ENABLED_PLUGINS_FILE=$R/enabled_plugins \
    RABBITMQ_MNESIA_BASE=$RN/mnesia RABBITMQ_LOG_BASE=$RN/log RABBITMQ_PID_FILE=$RN/rabbit.pid
}

# rmq_cli TOOL ARGS...: a RabbitMQ CLI tool against the current node.
rmq_cli() {
  local tool=$1
  shift
  (rmq_env && cd "$RN" && exec "$RMQBIN/$tool" "$@")
}
rmqctl() { rmq_cli rabbitmqctl "$@"; }

# pg_select S: PostgreSQL server S becomes the current one (1: the first primary, in $P/data;
# 2: the standby, in $P/data2).
pg_select() {
  PGS=$1
  if [ "$1" = 1 ]; then
    PGD=$P/data PGP=$PG_PORT PGL=$P/server.log PGC=$P/pg_ctl.log
  else
    PGD=$P/data2 PGP=$PG2_PORT PGL=$P/server2.log PGC=$P/pg_ctl2.log
  fi
}

# pg_primary: the number of the server that is the primary (2 after pg-promote).
pg_primary() {
  local p
  p=$(cat "$P/primary" 2>/dev/null || true)
  echo "${p:-1}"
}

# pg_order: the primary first, then the other server if there is one.
pg_order() {
  local pri
  pri=$(pg_primary)
  if [ "$PG_STANDBY" = 1 ]; then echo "$pri" $((3 - pri)); else echo 1; fi
}

check_server() {
  case "$1" in
    1) ;;
    2) [ "$PG_STANDBY" = 1 ] || die "no PostgreSQL server 2 in $D (start with --pg-standby)" ;;
    *) die "--node needs a PostgreSQL server number (1 or 2)" ;;
  esac
}

# ---------------------------------------------------------------- TLS

# tls_init: a private CA, a server certificate for localhost/127.0.0.1, one for a wrong name and
# a client certificate (CN idem_client), all under $T; once per instance. EC P-256: instant.
tls_init() {
  [ -s "$T/client.pem" ] && return 0
  mkdir -p "$T"
  chmod 755 "$T"
  cat >"$T/openssl.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,DNS:127.0.0.1,IP:127.0.0.1,IP:::1
authorityKeyIdentifier = keyid
[wrong]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:$TLS_WRONG_NAME
authorityKeyIdentifier = keyid
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
CNF
  local newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes) c
  if ! (
    set -e
    cd "$T"
    umask 077
    openssl req -x509 -new -config openssl.cnf -extensions ca "${newkey[@]}" -keyout ca.key \
      -out ca.pem -days 3650 -subj "/CN=idem test CA"
    for c in server:localhost wrong:$TLS_WRONG_NAME client:$TLS_CLIENT_USER; do
      openssl req -new -config openssl.cnf "${newkey[@]}" -keyout "${c%%:*}.key" -out "${c%%:*}.csr" \
        -subj "/CN=${c#*:}"
      openssl x509 -req -in "${c%%:*}.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
        -extfile openssl.cnf -extensions "${c%%:*}" -out "${c%%:*}.pem"
    done
    chmod 644 ./*.pem
    rm -f ./*.csr
  ) >"$T/openssl.log" 2>&1 </dev/null; then
    tail -n 20 "$T/openssl.log" >&2
    die "creating the TLS certificates in $T failed"
  fi
}

# tls_server: the certificate the servers present (server, or wrong with --tls-wrong-name).
tls_server() { if [ "$TLS_WRONG" = 1 ]; then echo wrong; else echo server; fi; }

# ---------------------------------------------------------------- PostgreSQL

pg_logtail() {
  local f
  for f in "$P/initdb.log" "$P/basebackup.log" "$PGC" "$PGL"; do
    [ -s "$f" ] || continue
    printf -- '--- %s (tail)\n' "$f" >&2
    tail -n 30 "$f" >&2
  done
}

# pg_sql PORT SQL: one statement as postgres in database postgres; prints the rows unaligned.
pg_sql() {
  "$PGBIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2" \
    </dev/null
}

# pg_wait_sql PORT SQL SECONDS: until SQL returns the single value t.
pg_wait_sql() {
  local n=$(($3 * 10))
  until [ "$(pg_sql "$1" "$2" 2>/dev/null)" = t ]; do
    [ "$n" -gt 0 ] || return 1
    n=$((n - 1))
    sleep 0.1
  done
}

# pg_conf_local: the settings of the current server that a base backup must not carry over.
pg_conf_local() {
  {
    echo "port = $PGP"
    [ "$PG_STANDBY" = 1 ] && echo "cluster_name = 'idem_pg$PGS'" # = the walreceiver's application_name
    true
  } >>"$PGD/postgresql.conf"
}

pg_init() {
  pg_select 1
  mkdir -p "$P/sock"
  chown postgres: "$P" "$P/sock"
  install -d -m 700 -o postgres -g postgres "$PGD"
  local nosync=()
  [ "$DURABLE" = 1 ] || nosync=(-N)
  # cd: postgres needs a cwd it can read.
  if ! (cd "$P" && exec runuser -u postgres -- "$PGBIN/initdb" -D "$PGD" -U postgres -A trust \
    -E UTF8 --locale=C "${nosync[@]}") >"$P/initdb.log" 2>&1 </dev/null; then
    pg_logtail
    die "initdb failed in $PGD"
  fi
  if [ "$TLS" = 1 ]; then
    # The key must belong to postgres with mode 0600; the standby uses the same files.
    install -d -m 755 -o postgres -g postgres "$P/tls"
    install -m 644 -o postgres -g postgres "$T/$(tls_server).pem" "$P/tls/server.pem"
    install -m 600 -o postgres -g postgres "$T/$(tls_server).key" "$P/tls/server.key"
  fi
  {
    echo "# idem private instance"
    echo "listen_addresses = '127.0.0.1'"
    echo "unix_socket_directories = '$P/sock'"
    echo "max_connections = 200"
    if [ "$DURABLE" != 1 ]; then
      echo "fsync = off"
      echo "full_page_writes = off"
      # A synchronous standby is pointless if commits do not wait for it.
      [ "$PG_STANDBY" = 1 ] || echo "synchronous_commit = off"
    fi
    if [ "$PG_STANDBY" = 1 ]; then
      echo "wal_level = replica"
      echo "max_wal_senders = 10"
      echo "wal_keep_size = '256MB'"
      echo "hot_standby = on"
      # synchronous_standby_names is set on the primary only, by ALTER SYSTEM, once its standby
      # streams (see pg_sync_on): a base backup then never copies it to a standby.
    fi
    if [ "$TLS" = 1 ]; then
      echo "ssl = on"
      echo "ssl_cert_file = '$P/tls/server.pem'"
      echo "ssl_key_file = '$P/tls/server.key'"
      echo "ssl_ca_file = '$T/ca.pem'" # client certificates are checked when one is sent
    fi
  } >>"$PGD/postgresql.conf"
  pg_conf_local
  # First match wins: our entries go before initdb's.
  {
    echo "# idem private instance"
    if [ "$TLS" = 1 ]; then
      echo "hostnossl all $TLS_CLIENT_USER all reject"
      echo "hostssl all $TLS_CLIENT_USER 127.0.0.1/32 trust clientcert=verify-full"
      echo "hostssl all all 127.0.0.1/32 trust"
    fi
    [ "$PG_STANDBY" = 1 ] && echo "host replication postgres 127.0.0.1/32 trust"
    cat "$PGD/pg_hba.conf"
  } >"$P/pg_hba.conf.new"
  chown postgres: "$P/pg_hba.conf.new"
  mv "$P/pg_hba.conf.new" "$PGD/pg_hba.conf"
}

pg_running() { alive "$(head -n1 "$PGD/postmaster.pid" 2>/dev/null || true)"; }

pg_start() {
  if pg_running; then
    log "PostgreSQL already running on 127.0.0.1:$PGP"
    return 0
  fi
  if ! (cd "$P" && exec runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGD" -l "$PGL" \
    -w -t 90 start) >"$PGC" 2>&1 </dev/null; then
    pg_logtail
    die "PostgreSQL did not start on 127.0.0.1:$PGP"
  fi
  local n=200
  until "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PGP" -t 2; do
    n=$((n - 1))
    if [ "$n" -le 0 ]; then
      pg_logtail
      die "PostgreSQL not ready on 127.0.0.1:$PGP"
    fi
    sleep 0.05
  done
}

pg_createdb() {
  local have
  have=$(pg_sql "$PGP" "select 1 from pg_database where datname = 'idem'") || {
    pg_logtail
    die "cannot query PostgreSQL on 127.0.0.1:$PGP"
  }
  if [ "$have" != 1 ]; then
    "$PGBIN/createdb" -h 127.0.0.1 -p "$PGP" -U postgres idem || die "createdb idem failed"
  fi
  [ "$TLS" = 1 ] || return 0
  pg_sql "$PGP" "do \$\$ begin if not exists (select from pg_roles where rolname = '$TLS_CLIENT_USER')
    then create role $TLS_CLIENT_USER login superuser; end if; end \$\$" ||
    die "creating role $TLS_CLIENT_USER failed"
}

# pg_stop MODE: stop the current server (fast or immediate); no-op if it is not running.
pg_stop() {
  local mode=${1:-fast} pid
  [ -d "$PGD" ] || return 0
  pid=$(head -n1 "$PGD/postmaster.pid" 2>/dev/null || true)
  alive "$pid" || return 0
  (cd "$P" && exec runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGD" -m "$mode" -w -t 30 stop) \
    >>"$PGC" 2>&1 </dev/null || true
  if alive "$pid"; then
    log "pg_ctl stop did not stop PostgreSQL (pid $pid); sending SIGQUIT"
    kill -QUIT "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
  fi
  wait_gone "$pid" 5 || true
}

# pg_sync_on PRIMARY STANDBY: once STANDBY streams from PRIMARY, make it PRIMARY's synchronous
# standby and wait until pg_stat_replication says sync.
pg_sync_on() {
  local app=idem_pg$2 port
  port=$(pg_select "$1" && echo "$PGP")
  pg_wait_sql "$port" "select count(*) = 1 from pg_stat_replication
    where application_name = '$app' and state = 'streaming'" 60 || {
    pg_select "$2"
    pg_logtail
    die "PostgreSQL server $2 does not stream from server $1 (127.0.0.1:$port)"
  }
  pg_sql "$port" "alter system set synchronous_standby_names = '$app'" >/dev/null ||
    die "cannot set synchronous_standby_names on server $1"
  pg_sql "$port" "select pg_reload_conf()" >/dev/null
  pg_wait_sql "$port" "select count(*) = 1 from pg_stat_replication
    where application_name = '$app' and sync_state = 'sync'" 30 ||
    die "PostgreSQL server $2 did not become the synchronous standby of server $1"
}

# pg_standby_create PRIMARY STANDBY: (re)make server STANDBY as a streaming copy of PRIMARY
# (pg_basebackup -R), start it and make it synchronous.
pg_standby_create() {
  local src=$1 dst=$2 port nosync=()
  port=$(pg_select "$src" && echo "$PGP")
  pg_select "$dst"
  pg_stop immediate # a former primary: its data is thrown away
  rm -rf -- "$PGD"
  install -d -m 700 -o postgres -g postgres "$PGD"
  [ "$DURABLE" = 1 ] || nosync=(--no-sync)
  if ! (cd "$P" && exec runuser -u postgres -- "$PGBIN/pg_basebackup" -h 127.0.0.1 -p "$port" \
    -U postgres -D "$PGD" -R -X stream -c fast "${nosync[@]}") >"$P/basebackup.log" 2>&1 </dev/null; then
    pg_logtail
    die "pg_basebackup of server $src (127.0.0.1:$port) into $PGD failed"
  fi
  pg_conf_local
  # A standby must never wait for a standby of its own once promoted.
  sed -i '/^[[:space:]]*synchronous_standby_names/d' "$PGD/postgresql.auto.conf"
  pg_start
  pg_sync_on "$src" "$dst"
}

# pg_up: what `start` needs: created once, the primary, the idem database, the standby.
pg_up() {
  local pri other
  [ -f "$P/data/PG_VERSION" ] || pg_init
  pri=$(pg_primary)
  pg_select "$pri"
  pg_start
  pg_createdb
  [ "$PG_STANDBY" = 1 ] || return 0
  other=$((3 - pri))
  pg_select "$other"
  if [ ! -f "$PGD/PG_VERSION" ]; then
    pg_standby_create "$pri" "$other"
  elif [ -f "$PGD/standby.signal" ]; then
    pg_start
    pg_sync_on "$pri" "$other"
  else
    log "note: PostgreSQL server $other is a former primary and stays stopped" \
      "(pg-rejoin rebuilds it as a standby)"
  fi
}

# pg_down: stop every server, the primary first (its standby then has all its WAL).
pg_down() {
  local s
  for s in $(pg_order); do
    pg_select "$s"
    pg_stop fast
  done
}

# ---------------------------------------------------------------- RabbitMQ

rmq_logtail() {
  local f
  # Most telling last: a boot that fails early (bad config) only writes to stdout.log.
  for f in "$R/log/epmd.log" "$RN/log/$NODENAME.log" "$RN/log/join.log" "$RN/log/wait.log" \
    "$RN/log/stdout.log"; do
    [ -s "$f" ] || continue
    printf -- '--- %s (tail)\n' "$f" >&2
    tail -n 25 "$f" >&2
  done
}

rmq_init() {
  local k
  mkdir -p "$R/home" "$R/log"
  chmod 700 "$R/home"
  # A private HOME gives a private cookie, shared by the nodes; create it first so that servers
  # and CLI agree.
  od -An -N20 -tu1 /dev/urandom | awk '{for(i=1;i<=NF;i++) printf "%c",65+$i%26}' >"$R/home/.erlang.cookie"
  chmod 400 "$R/home/.erlang.cookie"
  : >"$R/rabbitmq-env.conf" # shadows /etc/rabbitmq/rabbitmq-env.conf
  if [ "$HASH_PLUGIN" = 1 ]; then
    echo "[$HASH_PLUGIN_NAME]." >"$R/enabled_plugins"
  else
    echo '[].' >"$R/enabled_plugins"
  fi
  for k in $(seq "$RMQ_NODES"); do
    node_select "$k"
    mkdir -p "$RN/mnesia" "$RN/log"
    {
      printf 'listeners.tcp.default = 127.0.0.1:%s\nloopback_users.guest = true\n' "$AMQP_PORT"
      printf 'log.file.level = info\nlog.console = false\n'
      if [ "$TLS" = 1 ]; then
        printf 'listeners.ssl.default = 127.0.0.1:%s\n' "$AMQPS_PORT"
        printf 'ssl_options.cacertfile = %s\n' "$T/ca.pem"
        printf 'ssl_options.certfile = %s\n' "$T/$(tls_server).pem"
        printf 'ssl_options.keyfile = %s\n' "$T/$(tls_server).key"
        printf 'ssl_options.verify = verify_peer\n'
        printf 'ssl_options.fail_if_no_peer_cert = %s\n' "$([ "$TLS_MUTUAL" = 1 ] && echo true || echo false)"
      fi
    } >"$RN/rabbitmq.conf"
  done
}

epmd_start() {
  alive "$(readpid "$R/epmd.pid")" && return 0
  # Foreground epmd in its own session: we own its PID and terminal Ctrl-C does not reach it.
  # One epmd for all nodes: it is also their private name space.
  (node_select 1 && rmq_env && cd "$R" && exec setsid "$EPMD" -port "$EPMD_PORT" -address 127.0.0.1) \
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

rmq_running() { alive "$(readpid "$RN/beam.pid")"; }

# rmq_boot: start the current node and wait until it is ready (epmd must be running).
rmq_boot() {
  if rmq_running; then
    log "RabbitMQ node $NODE already running on 127.0.0.1:$AMQP_PORT"
    return 0
  fi
  rm -f "$RN/rabbit.pid" "$RN/beam.pid"
  (rmq_env && cd "$RN" && exec setsid "$RMQBIN/rabbitmq-server") >>"$RN/log/stdout.log" 2>&1 </dev/null &
  local launcher=$! n=1200 beam="" p
  echo "$launcher" >"$RN/launcher.pid"
  while :; do
    beam=$(readpid "$RN/rabbit.pid")
    [ -n "$beam" ] && break
    if ! alive "$launcher" || [ "$n" -le 0 ]; then
      rmq_logtail
      die "RabbitMQ node $NODE did not start (launcher exited or no pid file after 60 s)"
    fi
    n=$((n - 1))
    sleep 0.05
  done
  # The pid file disappears early in shutdown: keep our own copy to wait on.
  echo "$beam" >"$RN/beam.pid"
  # In the background: bash runs a trap only once a foreground child is done, and this takes seconds.
  rmqctl -q wait --pid "$beam" --timeout 90 >"$RN/log/wait.log" 2>&1 </dev/null &
  if ! wait $!; then
    rmq_logtail
    die "RabbitMQ node $NODENAME not ready on 127.0.0.1:$AMQP_PORT"
  fi
  for p in "$AMQP_PORT" $AMQPS_PORT; do
    port_open "$p" || {
      rmq_logtail
      die "RabbitMQ node $NODENAME ready but nothing listens on 127.0.0.1:$p"
    }
  done
}

# rmq_join: the current node (> 1) joins node 1's cluster, once (it remembers that when restarted).
rmq_join() {
  [ "$NODE" -gt 1 ] && [ ! -f "$RN/joined" ] || return 0
  local first=${NODENAMES[0]}
  if ! {
    rmqctl stop_app && rmqctl join_cluster "$first" && rmqctl start_app
  } >"$RN/log/join.log" 2>&1 </dev/null; then
    rmq_logtail
    die "RabbitMQ node $NODENAME could not join $first"
  fi
  touch "$RN/joined"
}

# rmq_check_plugin: the consistent-hash plugin is enabled on the current node, or is not with
# --no-hash-plugin (a misspelt name in enabled_plugins would be ignored silently).
rmq_check_plugin() {
  if rmq_cli rabbitmq-plugins -q is_enabled "$HASH_PLUGIN_NAME" >"$RN/log/plugins.log" 2>&1 </dev/null; then
    [ "$HASH_PLUGIN" = 1 ] || die "$HASH_PLUGIN_NAME is enabled on node $NODE despite --no-hash-plugin"
  else
    [ "$HASH_PLUGIN" = 0 ] || {
      cat "$RN/log/plugins.log" >&2
      die "$HASH_PLUGIN_NAME is not enabled on RabbitMQ node $NODENAME"
    }
  fi
}

rmq_halt() {
  local beam launcher
  beam=$(readpid "$RN/beam.pid")
  launcher=$(readpid "$RN/launcher.pid")
  # SIGTERM to beam is a graceful shutdown (and runs no CLI, which would respawn epmd).
  stop_pid "$beam" "RabbitMQ node $NODE (beam)" 30
  stop_pid "$launcher" "RabbitMQ node $NODE launcher" 5
  rm -f "$RN/beam.pid" "$RN/launcher.pid"
}

epmd_stop() {
  stop_pid "$(readpid "$R/epmd.pid")" epmd 5
  rm -f "$R/epmd.pid"
}

# each_node FUNCTION K...: FUNCTION for nodes K... at once, each in a subshell with the node
# selected; 1 if any failed (each prints its own error). The jobs are listed in NODE_JOBS.
NODE_JOBS=""
each_node() {
  local fn=$1 k pid rc=0 pids=()
  shift
  for k in "$@"; do
    (node_select "$k" && "$fn") &
    pids+=("$!")
    NODE_JOBS="$NODE_JOBS $!"
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return "$rc"
}

# rmq_up K...: start nodes K... (in parallel: boot is CPU-bound but mostly waiting), then let
# new ones join the cluster one at a time.
rmq_up() {
  local k
  epmd_start
  each_node rmq_boot "$@" || die "RabbitMQ did not start"
  for k in "$@"; do
    node_select "$k"
    rmq_join
  done
}

# rmq_cluster_check: node 1 sees all nodes running.
rmq_cluster_check() {
  local n
  node_select 1
  n=$(rmqctl -q cluster_status --formatter json </dev/null |
    "$PY" -c 'import json,sys; print(len(json.load(sys.stdin)["running_nodes"]))') ||
    die "rabbitmqctl cluster_status failed on $NODENAME"
  [ "$n" = "$RMQ_NODES" ] || die "RabbitMQ cluster: $n of $RMQ_NODES nodes running"
}

# rmq_first_running: the first node that runs (0 if none).
rmq_first_running() {
  local k
  for k in $(seq "$RMQ_NODES"); do
    node_select "$k"
    rmq_running && echo "$k" && return 0
  done
  echo 0
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
    log "leftover process $pid: $({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | cut -c1-120); terminating"
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $pids; do wait_gone "$pid" 3 || kill -KILL "$pid" 2>/dev/null || true; done
  for pid in $pids; do wait_gone "$pid" 3 || log "warning: process $pid still running"; done
}

# ---------------------------------------------------------------- commands

write_env() {
  local k urls="" surls="" q="" extra="" line
  # Line 1 as it always was: simple readers split env.sh on blanks and '='.
  line="export IDEM_PG_URL=postgresql://postgres@127.0.0.1:$PG_PORT/idem"
  line="$line IDEM_AMQP_URL=amqp://guest:guest@127.0.0.1:${AMQP_PORTS[0]} IDEM_SVC_DIR=$D"
  line="$line IDEM_PG_PORT=$PG_PORT IDEM_AMQP_PORT=${AMQP_PORTS[0]}"
  if [ "$TLS" = 1 ]; then
    q="?cacertfile=$T/ca.pem"
    [ "$TLS_MUTUAL" = 1 ] && q="$q&certfile=$T/client.pem&keyfile=$T/client.key"
  fi
  {
    echo "$line"
    for k in $(seq "$RMQ_NODES"); do
      node_select "$k"
      urls="$urls${urls:+,}amqp://guest:guest@127.0.0.1:$AMQP_PORT"
      extra="$extra IDEM_AMQP_PORT_$k=$AMQP_PORT IDEM_RMQ_NODE_$k=$NODENAME"
      if [ "$TLS" = 1 ]; then
        surls="$surls${surls:+,}amqps://guest:guest@127.0.0.1:$AMQPS_PORT$q"
        extra="$extra IDEM_AMQPS_PORT_$k=$AMQPS_PORT"
      fi
    done
    echo "export IDEM_RMQ_NODES=$RMQ_NODES IDEM_AMQP_URLS=$urls IDEM_RMQ_HASH_PLUGIN=$HASH_PLUGIN"
    echo "export${extra}"
    if [ "$PG_STANDBY" = 1 ]; then
      echo "export IDEM_PG_STANDBY_PORT=$PG2_PORT IDEM_PG_URL_HA=$(shq \
        "postgresql://postgres@127.0.0.1:$PG_PORT,127.0.0.1:$PG2_PORT/idem?target_session_attrs=read-write")"
    fi
    if [ "$TLS" = 1 ]; then
      echo "export IDEM_TLS_DIR=$T IDEM_TLS_CA=$T/ca.pem IDEM_TLS_CLIENT_CERT=$T/client.pem" \
        "IDEM_TLS_CLIENT_KEY=$T/client.key IDEM_TLS_CLIENT_USER=$TLS_CLIENT_USER"
      echo "export IDEM_TLS_SERVER_CERT=$T/$(tls_server).pem IDEM_TLS_WRONG_CERT=$T/wrong.pem" \
        "IDEM_TLS_WRONG_KEY=$T/wrong.key IDEM_TLS_MUTUAL=$TLS_MUTUAL" \
        "IDEM_TLS_SERVER_NAME=$([ "$TLS_WRONG" = 1 ] && echo "$TLS_WRONG_NAME" || echo localhost)"
      echo "export IDEM_AMQPS_PORT=${AMQPS_PORTS[0]} IDEM_AMQPS_URL=$(shq "${surls%%,*}")" \
        "IDEM_AMQPS_URLS=$(shq "$surls")"
      echo "export IDEM_PG_TLS_URL=$(shq \
        "postgresql://postgres@127.0.0.1:$PG_PORT/idem?sslmode=verify-full&sslrootcert=$T/ca.pem")"
    fi
  } >"$D/env.sh.tmp"
  mv "$D/env.sh.tmp" "$D/env.sh"
}

# parse_start_opts ARGS...: the OPTIONS of start and with, into O_*.
parse_start_opts() {
  O_DURABLE=0 O_NODES=1 O_HASH=1 O_STANDBY=0 O_TLS=0 O_MTLS=0 O_WRONG=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --durable) O_DURABLE=1 ;;
      --no-hash-plugin) O_HASH=0 ;;
      --rmq-nodes)
        [ $# -ge 2 ] || usage
        case "$2" in [1-9]) O_NODES=$2 ;; *) log "error: --rmq-nodes takes 1 to 9, not '$2'" && exit 2 ;; esac
        shift
        ;;
      --pg-standby) O_STANDBY=1 ;;
      --tls) O_TLS=1 ;;
      --mtls) O_TLS=1 O_MTLS=1 ;;
      --tls-wrong-name) O_TLS=1 O_WRONG=1 ;;
      *) usage ;;
    esac
    shift
  done
}

cmd_start() {
  set_dir "${1:-}"
  shift
  parse_start_opts "$@"
  local t0=$SECONDS
  mkdir -p "$D"
  chmod 755 "$D"
  runuser -u postgres -- test -x "$D" ||
    die "user postgres cannot reach $D (every parent directory must be traversable; use /tmp)"

  if [ -f "$STATE" ]; then
    load_state
    local v have want
    for v in DURABLE:O_DURABLE RMQ_NODES:O_NODES HASH_PLUGIN:O_HASH PG_STANDBY:O_STANDBY TLS:O_TLS \
      TLS_MUTUAL:O_MTLS TLS_WRONG:O_WRONG; do
      have=${v%%:*} want=${v#*:}
      [ "${!have}" = "${!want}" ] || log "note: $D was created with $have=${!have}; keeping that"
    done
    log "reusing instance in $D (PostgreSQL $PG_PORT, RabbitMQ ${AMQP_PORTS[*]})"
  else
    DURABLE=$O_DURABLE RMQ_NODES=$O_NODES HASH_PLUGIN=$O_HASH PG_STANDBY=$O_STANDBY TLS=$O_TLS
    TLS_MUTUAL=$O_MTLS TLS_WRONG=$O_WRONG
    # PostgreSQL (1 or 2), epmd, CLI range, then AMQP, dist (and amqps) per node.
    local per=$((2 + TLS)) nports ports k i base
    nports=$((3 + PG_STANDBY + RMQ_NODES * per))
    read -r -a ports <<<"$(pick_ports "$nports")"
    [ ${#ports[@]} -eq "$nports" ] || die "could not find free loopback ports"
    PG_PORT=${IDEM_PG_PORT:-${ports[0]}}
    EPMD_PORT=${ports[1]}
    # The CLI takes any free port in its range; a private range just avoids needless sharing.
    CTL_MIN=${ports[2]}
    CTL_MAX=$((CTL_MIN + 9))
    PG2_PORT=""
    [ "$PG_STANDBY" = 1 ] && PG2_PORT=${ports[3]}
    base="idem-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
    NODENAMES=() AMQP_PORTS=() DIST_PORTS=() AMQPS_PORTS=()
    for k in $(seq "$RMQ_NODES"); do
      i=$((3 + PG_STANDBY + (k - 1) * per))
      AMQP_PORTS+=("${ports[$i]}")
      DIST_PORTS+=("${ports[$((i + 1))]}")
      [ "$TLS" = 1 ] && AMQPS_PORTS+=("${ports[$((i + 2))]}")
      if [ "$RMQ_NODES" = 1 ]; then NODENAMES+=("$base@localhost"); else NODENAMES+=("$base-$k@localhost"); fi
    done
    AMQP_PORTS[0]=${IDEM_AMQP_PORT:-${AMQP_PORTS[0]}}
    port_free "$PG_PORT" || die "port $PG_PORT on 127.0.0.1 is in use${IDEM_PG_PORT:+ (IDEM_PG_PORT)}"
    port_free "${AMQP_PORTS[0]}" ||
      die "port ${AMQP_PORTS[0]} on 127.0.0.1 is in use${IDEM_AMQP_PORT:+ (IDEM_AMQP_PORT)}"
    # Node 1 also as plain names: what an instance of a single node always had.
    cat >"$STATE" <<EOS
PG_PORT=$PG_PORT
AMQP_PORT=${AMQP_PORTS[0]}
DIST_PORT=${DIST_PORTS[0]}
EPMD_PORT=$EPMD_PORT
CTL_MIN=$CTL_MIN
CTL_MAX=$CTL_MAX
NODENAME=${NODENAMES[0]}
DURABLE=$DURABLE
RMQ_NODES=$RMQ_NODES
NODENAMES=(${NODENAMES[*]})
AMQP_PORTS=(${AMQP_PORTS[*]})
DIST_PORTS=(${DIST_PORTS[*]})
AMQPS_PORTS=(${AMQPS_PORTS[*]})
HASH_PLUGIN=$HASH_PLUGIN
PG_STANDBY=$PG_STANDBY
PG2_PORT=$PG2_PORT
TLS=$TLS
TLS_MUTUAL=$TLS_MUTUAL
TLS_WRONG=$TLS_WRONG
EOS
    [ "$TLS" = 1 ] && tls_init
    rmq_init
    mkdir -p "$P"
  fi

  # On any failure or interruption from here on, stop whatever did start.
  START_PGJOB=""
  trap 'start_failed' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  # Both servers at once: PostgreSQL is ready in ~1 s, RabbitMQ in 5-10 s (CPU-bound boot).
  pg_up &
  START_PGJOB=$!
  rmq_up $(seq "$RMQ_NODES")
  # Checked at each start: a misspelt plugin name or a failed join would go unnoticed.
  each_node rmq_check_plugin $(seq "$RMQ_NODES") || exit 1
  [ "$RMQ_NODES" = 1 ] || rmq_cluster_check
  wait "$START_PGJOB" || exit 1
  START_PGJOB=""
  write_env
  trap - EXIT INT TERM
  local what="RabbitMQ 127.0.0.1:${AMQP_PORTS[*]}"
  [ "$RMQ_NODES" = 1 ] || what="RabbitMQ cluster of $RMQ_NODES nodes (127.0.0.1:${AMQP_PORTS[*]})"
  [ "$HASH_PLUGIN" = 1 ] || what="$what without $HASH_PLUGIN_NAME"
  local pgwhat
  pg_select "$(pg_primary)"
  pgwhat="PostgreSQL 127.0.0.1:$PGP"
  if [ "$PG_STANDBY" = 1 ] && pg_select $((3 - PGS)) && pg_running; then
    pgwhat="$pgwhat with synchronous standby 127.0.0.1:$PGP"
  fi
  [ "$DURABLE" = 1 ] && pgwhat="$pgwhat (durable)"
  if [ "$TLS" = 1 ]; then
    what="$what, amqps ${AMQPS_PORTS[*]}"
    [ "$TLS_MUTUAL" = 1 ] && what="$what (client certificate required)"
    [ "$TLS_WRONG" = 1 ] && what="$what, certificates for $TLS_WRONG_NAME"
  fi
  log "$pgwhat, $what (${NODENAMES[0]}, epmd $EPMD_PORT) up in $((SECONDS - t0)) s"
  echo "$D/env.sh"
}

start_failed() {
  local rc=$? pid
  trap - EXIT
  trap '' INT TERM
  [ "$rc" = 0 ] && return 0
  log "start failed; stopping what did start in $D"
  [ -n "${START_PGJOB:-}" ] && wait "$START_PGJOB" 2>/dev/null
  # Node jobs still booting would go on; what they started is stopped or reaped below.
  for pid in $NODE_JOBS; do kill -TERM "$pid" 2>/dev/null || true; done
  do_stop
  exit "$rc"
}

do_stop() {
  if [ -f "$STATE" ]; then
    load_state
    pg_down &
    local pgjob=$!
    each_node rmq_halt $(seq "$RMQ_NODES") || true
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
  local op=$1 mode=fast targets="" s pri
  set_dir "${2:-}"
  shift 2
  load_state
  while [ $# -gt 0 ]; do
    case "$1" in
      --immediate)
        [ "$op" = stop ] || usage
        mode=immediate
        ;;
      --node)
        check_server "${2:-}"
        targets=$2
        shift
        ;;
      --all) targets=$(pg_order) ;;
      *) usage ;;
    esac
    shift
  done
  pri=$(pg_primary)
  case "$op" in
    stop)
      for s in ${targets:-$pri}; do
        pg_select "$s"
        pg_stop "$mode"
      done
      ;;
    start)
      for s in ${targets:-$(pg_order)}; do
        pg_select "$s"
        if [ "$s" != "$pri" ] && [ ! -f "$PGD/standby.signal" ]; then
          [ -z "$targets" ] && continue
          die "PostgreSQL server $s is a former primary; pg-rejoin $D rebuilds it as a standby"
        fi
        pg_start
        if [ "$s" != "$pri" ] && (pg_select "$pri" && pg_running); then
          pg_sync_on "$pri" "$s"
        fi
      done
      ;;
  esac
}

cmd_pg_promote() {
  set_dir "${1:-}"
  load_state
  [ "$PG_STANDBY" = 1 ] || die "no standby in $D (start with --pg-standby)"
  local t0=$SECONDS pri new
  pri=$(pg_primary)
  new=$((3 - pri))
  pg_select "$pri"
  ! pg_running ||
    die "the primary (server $pri, 127.0.0.1:$PGP) is running; stop it first (pg-stop $D --immediate)"
  pg_select "$new"
  pg_running || die "the standby (server $new, 127.0.0.1:$PGP) is not running"
  [ -f "$PGD/standby.signal" ] || die "server $new (127.0.0.1:$PGP) is not a standby"
  if ! (cd "$P" && exec runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGD" -w -t 60 promote) \
    >>"$PGC" 2>&1 </dev/null; then
    pg_logtail
    die "pg_ctl promote failed for server $new"
  fi
  # After a failover there is no standby: a commit must not wait for one.
  pg_sql "$PGP" "alter system set synchronous_standby_names = ''" >/dev/null ||
    die "cannot clear synchronous_standby_names on server $new"
  pg_sql "$PGP" "select pg_reload_conf()" >/dev/null
  pg_wait_sql "$PGP" "select not pg_is_in_recovery()
    and current_setting('synchronous_standby_names') = ''" 30 ||
    die "server $new is still in recovery after promotion"
  echo "$new" >"$P/primary"
  # A commit that gets an xid writes WAL and would wait for a synchronous standby.
  timeout 20 "$PGBIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGP" -U postgres -d idem \
    -c "select txid_current()" >/dev/null </dev/null || die "promoted server $new does not accept writes"
  log "promoted PostgreSQL server $new (127.0.0.1:$PGP) to primary in $((SECONDS - t0)) s"
}

cmd_pg_rejoin() {
  set_dir "${1:-}"
  load_state
  [ "$PG_STANDBY" = 1 ] || die "no standby in $D (start with --pg-standby)"
  local t0=$SECONDS pri
  pri=$(pg_primary)
  pg_select "$pri"
  pg_running || die "the primary (server $pri, 127.0.0.1:$PGP) is not running"
  pg_standby_create "$pri" $((3 - pri))
  log "PostgreSQL server $PGS (127.0.0.1:$PGP) is the synchronous standby of server $pri," \
    "in $((SECONDS - t0)) s"
}

cmd_rmq() {
  local op=$1 nodes
  set_dir "${2:-}"
  shift 2
  load_state
  nodes=$(seq "$RMQ_NODES")
  while [ $# -gt 0 ]; do
    case "$1" in
      --node)
        check_node "${2:-}"
        nodes=$2
        shift
        ;;
      *) usage ;;
    esac
    shift
  done
  # shellcheck disable=SC2086
  case "$op" in
    start) rmq_up $nodes ;;
    stop) each_node rmq_halt $nodes ;;
  esac
}

cmd_rmqctl() {
  set_dir "${1:-}"
  shift
  load_state
  local k
  if [ "${1:-}" = --node ]; then
    check_node "${2:-}"
    k=$2
    shift 2
  else
    k=$(rmq_first_running)
    [ "$k" != 0 ] || die "RabbitMQ of $D is not running"
  fi
  node_select "$k"
  rmq_running || die "RabbitMQ node $k of $D is not running"
  rmqctl "$@"
}

cmd_rmq_leader() {
  set_dir "${1:-}"
  [ -n "${2:-}" ] || usage
  local queue=$2 k out leader
  load_state
  k=$(rmq_first_running)
  [ "$k" != 0 ] || die "RabbitMQ of $D is not running"
  node_select "$k"
  out=$(rmqctl -q list_queues name leader --no-table-headers </dev/null) ||
    die "rabbitmqctl list_queues failed on node $k"
  leader=$(awk -F'\t' -v q="$queue" '$1 == q {print $2; exit}' <<<"$out")
  [ -n "$leader" ] || die "no quorum queue $queue with a leader in $D"
  for k in $(seq "$RMQ_NODES"); do
    [ "${NODENAMES[$((k - 1))]}" = "$leader" ] && echo "$k" && return 0
  done
  die "queue $queue is led by $leader, not a node of $D"
}

cmd_with() {
  local dir=${1:-} opts=()
  [ -n "$dir" ] || usage
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    opts+=("$1")
    shift
  done
  [ "${1:-}" = -- ] || usage
  shift
  [ $# -gt 0 ] || usage
  parse_start_opts "${opts[@]}" # usage errors before anything starts

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
  "$ME" start "$WITH_DIR" "${opts[@]}" >/dev/null </dev/null &
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
    pg-promote) cmd_pg_promote "$@" ;;
    pg-rejoin) cmd_pg_rejoin "$@" ;;
    rmq-start) cmd_rmq start "$@" ;;
    rmq-stop) cmd_rmq stop "$@" ;;
    rmqctl) cmd_rmqctl "$@" ;;
    rmq-leader) cmd_rmq_leader "$@" ;;
    with) cmd_with "$@" ;;
    -h | --help | help) usage ;;
    *) usage ;;
  esac
}

main "$@"
