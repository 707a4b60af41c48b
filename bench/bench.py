#!/usr/bin/python3
"""bench.py - idem's benchmark: every figure measured in one run beside its limit.

`make bench` runs it (as root, with Debian's /usr/bin/python3): it builds its tools
(bench/Makefile: raw_publish, raw_consume, emit_rate), starts private PostgreSQL (durable
defaults: fsync, synchronous_commit, full_page_writes on) and RabbitMQ instances in a temporary
directory, measures, and always stops them. Servers, database and broker access, the idem
daemons and their CPU and memory figures come from tests/harness/idem_harness.py.

    /usr/bin/python3 bench/bench.py [--quick] [--only relay,claim] [--keep]
    /usr/bin/python3 bench/bench.py --external   # the servers of IDEM_PG_URL, IDEM_AMQP_URL and
        # IDEM_SVC_DIR (it truncates idem's tables and deletes its bench.* queues: never point
        # it at data you keep)
    /usr/bin/python3 bench/bench.py --chart bench/results/latest.json   # redraw a chart only

Phases (all in one run, so the ratios compare figures taken under the same conditions):
  relay     backlog of --events pending rows over 500 subscriptions, drained by 1, 2, 4 relays;
            beside it the raw confirmed publisher (build/bench/raw_publish, window = --batch)
            into the same exchange and the same kind of queue, and the tutorial recipe
            (bench/recipe.py relay, time-capped).
  consumer  a full queue of --events payment.failed events consumed by `idem consume`; beside it
            the raw consume-and-ack loop (build/bench/raw_consume), the set-based SQL statement
            (bench/loadgen.py dblimit: 100 events per durable commit), and the recipe consumer
            (bench/recipe.py consume, time-capped).
  emit      idem_emit, one event a transaction, unpaced on 1, 4 and 16 connections, against the
            same transaction inserting the same row into a plain table of the outbox's shape
            and indexes (build/bench/emit_rate --plain), rounds alternating.
  steady    the whole pipeline under a steady load: emit_rate at each of --steady-rates (one
            event a transaction, 16 connections) for --steady-seconds with the relay and the
            consumer running; the backlog (pending rows + queued messages) sampled every second;
            the highest rate at which it stays bounded, and emit -> effect p50/p99 at each rate.
  latency   emit -> handler effect committed, at a steady --lat-rate (build/bench/emit_rate)
            and one event at a time (relay and consumer running as daemons); then the idle
            CPU of both over
            --idle-cpu-seconds, and their peak RSS (VmHWM) over the whole run.
  claim     the relay's claim statements as a running relay runs them (pg_stat_statements,
            planning + execution, server side; the relay daemon is paused with SIGSTOP while
            --claim-pending rows are emitted, then resumed to drain them), alone and beside
            --claim-sent sent rows.
  scale     (bench/scale.py; `scale-consumer` and `scale-cluster` one each) a partitioned
            consumer group of P = 1, 2, 4 processes draining the same --scale-events billing
            backlog, and one relay draining --scale-events pending rows into a 3-node RabbitMQ
            cluster beside the single node; with the CPU of idem, PostgreSQL and RabbitMQ and
            PostgreSQL's WAL flushes during each drain.

Throughputs come from the database's commit timestamps (track_commit_timestamp, turned on by
this script): (rows - rows of the first commit) / (last commit - first commit), the same for
idem, the recipe and the SQL limit; the raw tools time themselves with the same estimator.
Latency = commit time of the consumer's transaction (consumed_events row) - created_at of the
outbox row (the start of the emitting transaction). Medians over --rounds rounds.

Writes bench/results/latest.md, latest.json and latest.svg (each figure's ratio to its limit
beside its target, drawn with gnuplot); prints the table.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "harness"))
try:
    import psycopg2
    import idem_harness as H
except ImportError as e:
    sys.exit(f"bench: {e} (run with /usr/bin/python3; apt-get install python3-psycopg2 "
             "python3-pika, or make deps)")
import chart  # noqa: E402
import cost  # noqa: E402
import loadgen  # noqa: E402
import scale  # noqa: E402

PY = "/usr/bin/python3"
T0 = time.monotonic()
CHILDREN = set()  # H.Daemon
SERVERS = None  # H.Servers
DB = None  # H.Db: one kept connection (autocommit)
BROKER = None  # H.Broker


class Failure(Exception):
    pass


def log(msg):
    print(f"[bench {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def env_float(name, default):
    v = os.environ.get(name)
    return float(v) if v not in (None, "") else default


# ---------------------------------------------------------------------------- configuration


def parse_args():
    ap = argparse.ArgumentParser(description="idem benchmark (see the module docstring)")
    ap.add_argument("--quick", action="store_true",
                    default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                    help="small sizes, one round: checks that every piece runs (figures are "
                         "not meaningful); also BENCH_QUICK=1")
    ap.add_argument("--external", action="store_true",
                    help="use the servers of IDEM_PG_URL, IDEM_AMQP_URL and IDEM_SVC_DIR "
                         "(started with scripts/services.sh start DIR --durable) instead of "
                         "private ones")
    ap.add_argument("--keep", action="store_true",
                    default=os.environ.get("BENCH_KEEP", "") not in ("", "0"),
                    help="keep the private servers' directory (server logs, bench-logs/ with "
                         "idem's output); also BENCH_KEEP=1")
    ap.add_argument("--chart", metavar="JSON",
                    help="only draw the chart of a results file (latest.json), beside it")
    ap.add_argument("--only", default=os.environ.get("BENCH_ONLY", ""),
                    help="comma-separated phases: relay,consumer,latency,claim,scale "
                         "(scale = scale-consumer and scale-cluster); default all")
    ap.add_argument("--events", type=int, default=env_int("BENCH_EVENTS", 100000))
    ap.add_argument("--subscriptions", type=int, default=env_int("BENCH_SUBSCRIPTIONS", 500))
    ap.add_argument("--rounds", type=int, default=env_int("BENCH_ROUNDS", 3))
    ap.add_argument("--relays", default=os.environ.get("BENCH_RELAYS", "1,2,4"))
    ap.add_argument("--batch", type=int, default=env_int("BENCH_BATCH", 200))
    ap.add_argument("--recipe-seconds", type=float, default=env_float("BENCH_RECIPE_SECONDS", 5),
                    help="time cap of each recipe round")
    ap.add_argument("--recipe-fill", type=int, default=env_int("BENCH_RECIPE_FILL", 30000),
                    help="messages queued for the recipe consumer's rounds")
    ap.add_argument("--lat-rate", type=float, default=env_float("BENCH_LAT_RATE", 1000))
    ap.add_argument("--lat-rate-high", type=float, default=env_float("BENCH_LAT_RATE_HIGH", 5000),
                    help="the second, higher steady rate of the latency phase (5000; 0: none)")
    ap.add_argument("--lat-per-tx-high", type=int, default=env_int("BENCH_LAT_PER_TX_HIGH", 4),
                    help="events per emitting transaction at --lat-rate-high (4: one event per "
                         "transaction tops out near 1/commit time, since idem_emit's NOTIFY "
                         "makes PostgreSQL commit notifying transactions one at a time)")
    ap.add_argument("--emit-seconds", type=float, default=env_float("BENCH_EMIT_SECONDS", 5))
    ap.add_argument("--steady-seconds", type=float,
                    default=env_float("BENCH_STEADY_SECONDS", 60))
    ap.add_argument("--steady-rates", default=os.environ.get("BENCH_STEADY_RATES",
                                                             "1000,1500,2000,2500,3000,4000,5000"))
    ap.add_argument("--lat-seconds", type=float, default=env_float("BENCH_LAT_SECONDS", 5))
    ap.add_argument("--lat-rounds", type=int, default=env_int("BENCH_LAT_ROUNDS", 3))
    ap.add_argument("--idle-events", type=int, default=env_int("BENCH_IDLE_EVENTS", 40))
    ap.add_argument("--idle-gap-ms", type=float, default=env_float("BENCH_IDLE_GAP_MS", 150))
    ap.add_argument("--idle-cpu-seconds", type=float,
                    default=env_float("BENCH_IDLE_CPU_SECONDS", 10))
    ap.add_argument("--claim-sent", type=int, default=env_int("BENCH_CLAIM_SENT", 1000000))
    ap.add_argument("--claim-pending", type=int, default=env_int("BENCH_CLAIM_PENDING", 1000))
    ap.add_argument("--idem", default=os.environ.get("IDEM_BIN", os.path.join(ROOT, "build/idem")))
    ap.add_argument("--tools", default=os.environ.get("BENCH_TOOLS",
                                                      os.path.join(ROOT, "build/bench")))
    ap.add_argument("--relay-flags", default=os.environ.get("BENCH_RELAY_FLAGS", ""))
    ap.add_argument("--consumer-flags", default=os.environ.get("BENCH_CONSUMER_FLAGS", ""))
    ap.add_argument("--out", default=os.environ.get("BENCH_OUT", os.path.join(HERE, "results")))
    ap.add_argument("--logs", default=os.environ.get("BENCH_LOGS", ""))
    scale.add_args(ap)
    a = ap.parse_args()
    if a.quick:
        a.events = min(a.events, 10000)
        a.rounds = 1
        a.recipe_seconds = min(a.recipe_seconds, 2)
        a.recipe_fill = min(a.recipe_fill, 3000)
        a.lat_seconds = min(a.lat_seconds, 2)
        a.emit_seconds = min(a.emit_seconds, 1)
        a.steady_seconds = min(a.steady_seconds, 3)
        a.steady_rates = "500,1000"
        a.lat_rounds = 1
        a.idle_events = min(a.idle_events, 10)
        a.idle_cpu_seconds = min(a.idle_cpu_seconds, 3)
        a.claim_sent = min(a.claim_sent, 100000)
    a.steady_rates = [int(x) for x in a.steady_rates.replace(" ", ",").split(",") if x]
    a.relays = [int(x) for x in a.relays.replace(" ", ",").split(",") if x]
    a.only = set(x for x in a.only.replace(" ", ",").split(",") if x)
    scale.finish_args(a)
    return a


A = None  # the parsed arguments
RES = {"samples": {}, "errors": [], "notes": [], "checks": []}


def sample(key, value):
    RES["samples"].setdefault(key, []).append(value)


def note(msg):
    log("note: " + msg)
    RES["notes"].append(msg)


def check(msg):
    """A correctness observation made along the way (duplicates, dead letters, ...)."""
    log("check: " + msg)
    RES["checks"].append(msg)


# ---------------------------------------------------------------------------- processes


def spawn(args, name):
    """A daemon (H.Daemon) with its output appended to A.logs/NAME.log."""
    d = H.Daemon(name, args, A.logs, SERVERS.pg_url, SERVERS.amqp_url,
                 logpath=os.path.join(A.logs, name + ".log"))
    d.spawn(banner=f"\n=== {datetime.datetime.now().isoformat()} {shlex.join(args)}")
    CHILDREN.add(d)
    return d


def stop(d, timeout=20):
    """SIGTERM (continuing it if paused), then SIGKILL after timeout; returns the exit status."""
    rc = d.stop(timeout, kill_after=True)
    if rc == -signal.SIGKILL:
        log(f"{d.name} (pid {d.pid}) ignored SIGTERM for {timeout}s; killed it")
    CHILDREN.discard(d)
    return rc


def stop_all():
    for d in list(CHILDREN):
        try:
            stop(d, 5)
        except Exception:
            pass


def run_json(args, timeout=300, name=None):
    """Runs a tool that prints one JSON line last; returns it parsed."""
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                       stdin=subprocess.DEVNULL, timeout=timeout)
    lines = [x for x in r.stdout.decode().splitlines() if x.strip()]
    if r.returncode != 0 or not lines:
        raise Failure(f"{name or os.path.basename(args[0])} exited {r.returncode}: "
                      f"{r.stderr.decode().strip()[-500:]}")
    return json.loads(lines[-1])


def note_rss(role, procs):
    for d in procs:
        v = d.peak_rss_kib()
        if v is not None:
            sample(f"rss_kib.{role}", v)


# ---------------------------------------------------------------------------- database


def q(sql, args=None):
    """Rows of sql on the kept connection ([] for a statement without rows)."""
    with DB.connect() as conn, conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else []


def one(sql, args=None):
    rows = q(sql, args)
    return rows[0][0] if rows else None


def truncate(*tables):
    """Empties tables; with event_outbox also the record of emitted ids (idem_emitted_keys, when
    the schema has it), so that a run name used before (servers kept with --external) emits
    afresh instead of collapsing as a replay."""
    if ("idem.event_outbox" in tables and "idem.idem_emitted_keys" not in tables
            and one("SELECT to_regclass('idem.idem_emitted_keys') IS NOT NULL")):
        tables = tables + ("idem.idem_emitted_keys",)
    q("TRUNCATE " + ", ".join(tables))


def commit_rate(table, where, args=None):
    """(rows - rows of the first commit) / (last commit - first commit), from commit
    timestamps; returns (rate, rows, span_seconds)."""
    row = q(f"""
        WITH t AS (SELECT pg_xact_commit_timestamp(xmin) AS ts FROM {table} WHERE {where})
        SELECT count(*), extract(epoch FROM max(ts) - min(ts)),
               count(*) FILTER (WHERE ts = (SELECT min(ts) FROM t))
          FROM t""", args)[0]
    n, span, first = int(row[0]), float(row[1] or 0), int(row[2])
    if n == 0 or span <= 0:
        return 0.0, n, span
    return (n - first) / span, n, span


EMIT_BACKLOG_SQL = """
    SELECT count(idem.idem_emit('payment.failed', s, %(run)s || '-' || i,
               jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id', s,
                                  'amount_cents', 4999, 'currency', 'EUR',
                                  'reason', 'card_declined', 'bench_run', %(run)s)))
      FROM (SELECT i, (%(subs)s::uuid[])[1 + i %% %(nsubs)s] AS s
              FROM generate_series(0, %(n)s - 1) i
             WHERE i %% %(parts)s = %(part)s) x"""


def emit_backlog(n, run, checkpoint=True):
    """n pending payment.failed rows through idem_emit. Two transactions at once, on disjoint
    halves of the subscriptions (idem_emit holds a per-subscription lock until commit), when the
    number of subscriptions is even; else one. Then ANALYZE (every relay connection then plans
    its prepared statements again) and CHECKPOINT."""
    t = time.monotonic()
    parts = 2 if A.subscriptions % 2 == 0 else 1
    args = {"run": run, "subs": loadgen.SUBSCRIPTIONS[:A.subscriptions],
            "nsubs": A.subscriptions, "n": n, "parts": parts}
    errors = []

    def part(k):
        try:
            with H.Db(SERVERS.pg_url).connect(autocommit=False) as c, c.cursor() as cur:
                cur.execute(EMIT_BACKLOG_SQL, dict(args, part=k))
                c.commit()
        except Exception as e:
            errors.append(e)

    th = [threading.Thread(target=part, args=(k,)) for k in range(parts)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    if errors:
        raise Failure(f"emitting the backlog: {errors[0]}")
    q("ANALYZE idem.event_outbox")
    if checkpoint:
        q("CHECKPOINT")
    log(f"emitted {n} pending events ({run}) in {time.monotonic() - t:.1f}s")


def pending_left():
    return one("SELECT EXISTS (SELECT 1 FROM idem.event_outbox WHERE status = 'pending')")


def wait_for(pred, timeout, what, procs=(), interval=0.1):
    """H.wait_until, failing the phase (Failure) on a timeout or when one of procs exits."""
    try:
        H.wait_until(pred, timeout, interval, what, procs)
    except AssertionError as e:
        raise Failure(f"{what}: {e}") from None


# ---------------------------------------------------------------------------- broker chores


def tool(name):
    return os.path.join(A.tools, name)


def q_depth(queue):
    """{"messages": ready messages, "consumers": n} of queue; messages -1 if it does not exist."""
    info = BROKER.queue_info(queue)
    return {"messages": -1, "consumers": 0} if info is None else \
        {"messages": info[0], "consumers": info[1]}


def q_purge(queue):
    BROKER.purge_queue(queue)


def q_delete(queue):
    """Deletes a queue declared by idem consume and its dead-letter queue."""
    BROKER.delete_queue(queue)
    BROKER.delete_queue(queue + ".dlq")


def declare_queue(queue, *binds):
    """Has `idem consume` declare queue exactly as a consumer's (a quorum queue dead-lettering
    through QUEUE.dlx to QUEUE.dlq; bound to the exchange for binds, or for the bundled
    handlers' event types), so that every queue of the run is of the same kind."""
    args = [a for b in binds for a in ("--bind", b)] + shlex.split(A.consumer_flags)
    try:
        H.declare_consumer_topology(SERVERS, queue, A.logs, consumer="bench-declare", args=args)
    except AssertionError as e:
        raise Failure(f"declaring {queue}: {e}") from None


def fill_queue(queue, n, rk_type="payment.failed"):
    """n valid payment.failed messages straight into queue (default exchange)."""
    return run_json([tool("raw_publish"), "--exchange", "", "--routing-key", queue,
                     "--type", rk_type, "--count", str(n), "--window", "1000",
                     "--subscriptions", str(A.subscriptions)], 300)


def bind_sink():
    """bench.sink: a consumer's queue bound to payment.failed on the exchange, standing in for
    the consumers' queue while nothing consumes (the relay publishes mandatory)."""
    declare_queue("bench.sink", "payment.failed")


# ---------------------------------------------------------------------------- idem


def have_idem():
    return os.access(A.idem, os.X_OK)


def idem(*args):
    return [A.idem] + list(args)


def relay_cmd():
    return idem("relay", "--batch", str(A.batch)) + shlex.split(A.relay_flags)


def consumer_cmd():
    return idem("consume", "--consumer", "bench", "--queue", "bench.consumer") + \
        shlex.split(A.consumer_flags)


def migrate():
    if have_idem():
        r = H.run_idem("migrate", "--billing", pg_url=SERVERS.pg_url, amqp_url=SERVERS.amqp_url, env={})
        if r.returncode != 0:
            raise Failure("idem migrate failed: " + (r.stdout + r.stderr)[-500:])
        return
    note(f"{A.idem} not found: applied sql/*.sql with psycopg2 so that the limits and the "
         "recipe still run; idem's own figures are n/a")
    if one("SELECT to_regclass('idem.event_outbox') IS NOT NULL"):
        return
    for f in sorted(os.listdir(os.path.join(ROOT, "sql"))):
        if f.endswith(".sql"):
            with open(os.path.join(ROOT, "sql", f)) as fh:
                q(fh.read())


def setup_server():
    """Durable defaults checked; commit timestamps and pg_stat_statements turned on (needs one
    restart, through scripts/services.sh)."""
    settings = dict(q("SELECT name, setting FROM pg_settings WHERE name IN "
                      "('fsync','synchronous_commit','full_page_writes','wal_sync_method',"
                      "'track_commit_timestamp','shared_preload_libraries','server_version',"
                      "'shared_buffers','max_wal_size')"))
    for k in ("fsync", "synchronous_commit", "full_page_writes"):
        if settings.get(k) != "on":
            raise Failure(f"PostgreSQL runs with {k}={settings.get(k)}: the benchmark needs the "
                          "durable defaults (scripts/services.sh start DIR --durable)")
    need = settings.get("track_commit_timestamp") != "on" or \
        "pg_stat_statements" not in settings.get("shared_preload_libraries", "")
    if need:
        if not SERVERS.svc_dir:
            raise Failure("track_commit_timestamp/pg_stat_statements are off and IDEM_SVC_DIR "
                          "is not set, so the server cannot be restarted to turn them on")
        q("ALTER SYSTEM SET track_commit_timestamp = on")
        q("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        DB.close()
        SERVERS.pg_stop()
        SERVERS.pg_start()
        q("ALTER SYSTEM SET pg_stat_statements.track = 'none'")
        q("SELECT pg_reload_conf()")
        log("PostgreSQL restarted with track_commit_timestamp=on, pg_stat_statements loaded")
    q("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    RES["server"] = dict(q("SELECT name, setting FROM pg_settings WHERE name IN "
                           "('fsync','synchronous_commit','full_page_writes',"
                           "'wal_sync_method','track_commit_timestamp','server_version',"
                           "'shared_buffers','max_wal_size')"))


# ---------------------------------------------------------------------------- phase: relay


def phase_relay():
    n = A.events
    for qn in ("bench.consumer", "bench.recipe", "bench.raw"):
        q_delete(qn)
    bind_sink()
    for r in range(A.rounds):
        q_purge("bench.sink")
        meter = cost.Meter()
        raw = run_json([tool("raw_publish"), "--count", str(n), "--window", str(A.batch),
                        "--subscriptions", str(A.subscriptions)], 300)
        cost.record(RES, "raw_publish", meter.stop(), n)
        sample("raw_publish", raw["rate"])
        # the same without what the contract's v3 added to each message (BCC shard key,
        # x-idem-seq, user_id): what the broker spends on those, beside the relay's own cost
        q_purge("bench.sink")
        meter = cost.Meter()
        old = run_json([tool("raw_publish"), "--count", str(n), "--window", str(A.batch),
                        "--subscriptions", str(A.subscriptions), "--wire", "v2"], 300)
        cost.record(RES, "raw_publish_v2", meter.stop(), n)
        sample("raw_publish_v2", old["rate"])
        log(f"round {r + 1}: raw confirmed publish {raw['rate']:.0f} msg/s "
            f"({old['rate']:.0f} msg/s with v2 messages)")
        if not have_idem():
            continue
        for k in A.relays:
            truncate("idem.event_outbox")
            emit_backlog(n, f"relay{k}-r{r}")
            q_purge("bench.sink")
            procs = [spawn(relay_cmd(), f"relay{k}") for _ in range(k)]
            t = time.monotonic()
            meter = cost.Meter([p.pid for p in procs])
            wait_for(lambda: not pending_left(), max(60, n / 1000), f"{k} relay(s) draining",
                     procs)
            cost.record(RES, f"relay.{k}", meter.stop(), n)
            wall = time.monotonic() - t
            note_rss("relay", procs)
            rcs = [stop(p) for p in procs]
            if any(rc != 0 for rc in rcs):
                check(f"relay exit codes after SIGTERM: {rcs}")
            rate, rows, span = commit_rate("idem.event_outbox", "status = 'sent'")
            sample(f"relay.{k}", rate)
            depth = q_depth("bench.sink")["messages"]
            if rows != n or depth != n:
                check(f"round {r + 1}, {k} relay(s): {rows} rows sent, {depth} messages in the "
                      f"queue, for {n} events")
            log(f"round {r + 1}: {k} relay(s) {rate:.0f} msg/s (commit timestamps; wall "
                f"{n / wall:.0f}/s incl. start-up)")
    # the recipe: --rounds time-capped runs draining the head of one backlog of n rows
    truncate("idem.event_outbox")
    emit_backlog(n, "recipe-relay")
    q("CREATE INDEX bench_recipe_idx_outbox_pending ON idem.event_outbox (created_at) "
      "WHERE status = 'pending'")  # the recipe's own index (its step 1)
    q("ANALYZE idem.event_outbox")
    try:
        for r in range(A.rounds):
            q_purge("bench.sink")
            since = one("SELECT clock_timestamp()")
            out = run_json([PY, os.path.join(HERE, "recipe.py"), "relay", "--seconds",
                            str(A.recipe_seconds), "--batch", str(A.batch), "--drain"],
                           A.recipe_seconds + 120, "recipe.py relay")
            rate, rows, span = commit_rate("idem.event_outbox", "status = 'sent' AND sent_at >= %s",
                                           (since,))
            sample("recipe_relay", rate)
            log(f"round {r + 1}: recipe relay {rate:.0f} msg/s over {rows} rows ({out})")
    finally:
        q("DROP INDEX IF EXISTS bench_recipe_idx_outbox_pending")
    truncate("idem.event_outbox")
    q_delete("bench.sink")


# ---------------------------------------------------------------------------- phase: consumer


def consumed(consumer):
    return one("SELECT count(*) FROM idem.consumed_events WHERE consumer = %s", (consumer,))


def phase_consumer():
    n = A.events
    q_delete("bench.sink")
    declare_queue("bench.raw", "bench.raw")  # bound to a key nothing publishes
    if have_idem():
        q_purge("bench.consumer")
        declare_queue("bench.consumer")  # bound like the measured consumer's
    for r in range(A.rounds):
        # broker limit
        q_purge("bench.raw")
        fill_queue("bench.raw", n)
        raw = run_json([tool("raw_consume"), "--queue", "bench.raw", "--count", str(n),
                        "--prefetch", "200", "--ack-every", "100"], 300)
        sample("raw_consume", raw["rate"])
        log(f"round {r + 1}: raw consume+ack {raw['rate']:.0f} msg/s")
        # database limit
        truncate("idem.consumed_events", "billing.dunning")
        q("CHECKPOINT")
        out = run_json([PY, os.path.join(HERE, "loadgen.py"), "dblimit", "--events", str(n),
                        "--per-tx", "100", "--consumer", "bench-db",
                        "--subscriptions", str(A.subscriptions)], 600, "loadgen.py dblimit")
        rate, rows, span = commit_rate("idem.consumed_events", "consumer = 'bench-db'")
        sample("db_limit", rate)
        log(f"round {r + 1}: set-based SQL limit {rate:.0f} events/s ({out['wall_rate']:.0f}/s "
            "wall)")
        # idem
        if have_idem():
            truncate("idem.consumed_events", "billing.dunning")
            q_purge("bench.consumer")
            fill_queue("bench.consumer", n)
            q("CHECKPOINT")
            p = spawn(consumer_cmd(), "consumer")
            meter = cost.Meter([p.pid])
            wait_for(lambda: consumed("bench") >= n, max(60, n / 1000), "idem consume draining",
                     [p], 0.2)
            cost.record(RES, "consumer", meter.stop(), n)
            note_rss("consumer", [p])
            rc = stop(p)
            if rc != 0:
                check(f"idem consume exit code after SIGTERM: {rc}")
            rate, rows, span = commit_rate("idem.consumed_events", "consumer = 'bench'")
            sample("consumer", rate)
            steps = one("SELECT coalesce(sum(step), 0) FROM billing.dunning")
            dlq = q_depth("bench.consumer.dlq")["messages"]
            left = q_depth("bench.consumer")["messages"]
            if rows != n or steps != n or dlq > 0 or left > 0:
                check(f"round {r + 1}: consumer applied {rows}, dunning steps {steps}, "
                      f"dead-lettered {dlq}, left in queue {left}, for {n} events")
            log(f"round {r + 1}: idem consume {rate:.0f} events/s (commit timestamps)")
    q_delete("bench.raw")
    # the recipe consumer: --rounds time-capped runs on one full queue
    truncate("idem.consumed_events", "billing.dunning")
    q_delete("bench.recipe")
    declare_queue("bench.recipe", "bench.recipe")
    fill_queue("bench.recipe", A.recipe_fill)
    q("CHECKPOINT")
    for r in range(A.rounds):
        since = one("SELECT clock_timestamp()")
        out = run_json([PY, os.path.join(HERE, "recipe.py"), "consume", "--queue",
                        "bench.recipe", "--seconds", str(A.recipe_seconds), "--consumer",
                        "recipe"], A.recipe_seconds + 120, "recipe.py consume")
        rate, rows, span = commit_rate("idem.consumed_events",
                                       "consumer = 'recipe' AND consumed_at >= %s", (since,))
        sample("recipe_consumer", rate)
        log(f"round {r + 1}: recipe consumer {rate:.0f} events/s over {rows} events ({out})")
    q_delete("bench.recipe")
    truncate("idem.consumed_events", "billing.dunning")


# ---------------------------------------------------------------------------- phase: latency


LAT_SQL = """
SELECT count(*), count(c.event_id),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY l.ms),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY l.ms), max(l.ms),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY l.relay_ms),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY l.relay_ms), max(l.relay_ms),
       count(DISTINCT o.xmin::text), count(DISTINCT c.xmin::text)
  FROM idem.event_outbox o
  LEFT JOIN idem.consumed_events c ON c.event_id = o.event_id AND c.consumer = 'bench'
  CROSS JOIN LATERAL (
      SELECT extract(epoch FROM pg_xact_commit_timestamp(c.xmin) - o.created_at) * 1000 AS ms,
             extract(epoch FROM pg_xact_commit_timestamp(o.xmin) - o.created_at) * 1000
                 AS relay_ms) l
 WHERE o.payload ->> 'bench_run' = %s
"""


def run_consumed(run):
    return q("SELECT count(o.*), count(c.event_id) FROM idem.event_outbox o LEFT JOIN "
             "idem.consumed_events c ON c.event_id = o.event_id AND c.consumer = 'bench' "
             "WHERE o.payload ->> 'bench_run' = %s", (run,))[0]


def latency_of(run, procs):
    wait_for(lambda: (lambda t: t[0] > 0 and t[0] == t[1])(run_consumed(run)), 60,
             f"events of {run} applied", procs, 0.2)
    emitted, applied, p50, p99, mx, r50, r99, rmx, rtx, ctx = q(LAT_SQL, (run,))[0]
    # relay_*: emit -> the relay's mark-sent commit (after the broker's confirm), a breakdown;
    # *_transactions: how many transactions marked them sent / applied them (batching)
    return {"events": emitted, "applied": applied, "p50": p50, "p99": p99, "max": mx,
            "relay_p50": r50, "relay_p99": r99, "relay_max": rmx,
            "relay_transactions": rtx, "consumer_transactions": ctx}


def latency_round(run, rate, conns, procs, per_tx=1):
    """emit_rate at rate for --lat-seconds on conns connections, per_tx events a transaction;
    the latency of that run, with the emitter's own report under "emitter"."""
    out = run_json([tool("emit_rate"), "--rate", str(rate), "--seconds", str(A.lat_seconds),
                    "--run", run, "--conns", str(conns), "--per-tx", str(per_tx)],
                   A.lat_seconds + 120, "emit_rate")
    lat = latency_of(run, procs)
    lat["emitter"] = out
    return lat


PLAIN = "public.bench_plain_outbox"


def phase_emit():
    """idem_emit against a plain insert of the same row, one event a transaction (autocommit,
    durable commit), unpaced for --emit-seconds on 1, 4 and 16 connections; rounds alternate
    idem and plain so that both see the same server state."""
    if not have_idem():
        return
    q(f"DROP TABLE IF EXISTS {PLAIN}")
    q(f"CREATE TABLE {PLAIN} (LIKE idem.event_outbox INCLUDING ALL)")
    try:
        for conns in (1, 4, 16):
            for r in range(A.rounds):
                for kind in ("idem", "plain"):
                    truncate("idem.event_outbox", PLAIN)
                    q("CHECKPOINT")
                    run = f"emit-{kind}-{conns}-{r}"
                    args = [tool("emit_rate"), "--rate", "0", "--seconds", str(A.emit_seconds),
                            "--run", run, "--conns", str(conns)]
                    if kind == "plain":
                        args += ["--plain", PLAIN]
                    out = run_json(args, A.emit_seconds + 60, "emit_rate")
                    sample(f"emit.{kind}.{conns}", out["achieved_rate"])
                    log(f"emit {kind}, {conns} connection(s), round {r + 1}: "
                        f"{out['achieved_rate']:.0f} events/s")
    finally:
        q(f"DROP TABLE IF EXISTS {PLAIN}")
        truncate("idem.event_outbox")


def backlog_parts():
    """Events emitted but not applied yet, as cheaply as it can be read each second, and where
    they wait: pending outbox rows (a partial index: the relay is behind) and the consumer
    queue's messages (the consumer is behind)."""
    pend = one("SELECT count(*) FROM idem.event_outbox WHERE status = 'pending'")
    return pend, max(q_depth("bench.consumer")["messages"], 0)


def phase_steady():
    """emit_rate at each rate of --steady-rates for --steady-seconds (one event a transaction,
    16 connections) with the relay and the consumer running. Bounded: in the run's second half
    the backlog never exceeds two seconds of events, and it drains within 10 s of the last
    emit. The ladder stops at the first rate that is not bounded (or that the emitter itself
    cannot reach)."""
    if not have_idem():
        return
    truncate("idem.event_outbox", "idem.consumed_events", "billing.dunning")
    q("CHECKPOINT")
    relay = spawn(relay_cmd(), "relay-steady")
    cons = spawn(consumer_cmd(), "consumer-steady")
    procs = [relay, cons]
    RES["steady"] = []
    try:
        wait_for(lambda: q_depth("bench.consumer")["consumers"] >= 1, 30, "consumer ready",
                 procs, 0.2)
        time.sleep(1.0)
        for rate in A.steady_rates:
            run = f"steady-{rate}"
            em = subprocess.Popen([tool("emit_rate"), "--rate", str(rate), "--seconds",
                                   str(A.steady_seconds), "--run", run, "--conns", "16"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, cwd=ROOT)
            t0, seen = time.monotonic(), []
            while em.poll() is None:
                time.sleep(1.0)
                seen.append((time.monotonic() - t0,) + backlog_parts())
            out_s, err_s = em.communicate()
            if em.returncode != 0:
                raise Failure(f"emit_rate exited {em.returncode}: {err_s.decode()[-500:]}")
            out = json.loads([x for x in out_s.decode().splitlines() if x.strip()][-1])
            t_end = time.monotonic()
            drained = True
            try:
                H.wait_until(lambda: (lambda t: t[0] == t[1])(run_consumed(run)), 10, 0.2,
                             "drained", procs)
            except AssertionError:
                drained = False
            drain_s = time.monotonic() - t_end
            if not drained:
                wait_for(lambda: (lambda t: t[0] == t[1])(run_consumed(run)), 300,
                         f"{run} drained", procs, 0.5)
            half = [x for x in seen if x[0] >= A.steady_seconds / 2] or seen
            # the peak, and where the backlog waited then: the outbox (relay) or the queue
            at = max(half, key=lambda x: x[1] + x[2], default=(0, 0, 0))
            peak = at[1] + at[2]
            reached = out["achieved_rate"] >= 0.95 * rate
            bounded = reached and drained and peak <= 2 * rate
            lat = latency_of(run, procs)
            st = {"rate": rate, "achieved": out["achieved_rate"], "peak_backlog": peak,
                  "peak_outbox": at[1], "peak_queue": at[2],
                  "drain_s": drain_s, "bounded": bounded, "p50": lat["p50"],
                  "p99": lat["p99"], "max": lat["max"]}
            RES["steady"].append(st)
            note(f"steady {rate}/s: emitted {out['achieved_rate']:.0f}/s, backlog peak {peak} in "
                 f"the second half ({at[1]} pending in the outbox, {at[2]} in the consumer's "
                 f"queue), drained {drain_s:.1f} s after the last emit: "
                 f"{'bounded' if bounded else 'not bounded'}")
            log(f"steady {rate}/s for {A.steady_seconds:.0f} s: p50 {lat['p50']:.2f} ms, p99 "
                f"{lat['p99']:.2f} ms, max {lat['max']:.2f} ms")
            if not bounded:
                break
    finally:
        for p in procs:
            rc = stop(p)
            if rc != 0:
                check(f"{p.name} exit code after SIGTERM: {rc}")


def phase_latency():
    if not have_idem():
        return
    for qn in ("bench.sink", "bench.raw", "bench.recipe"):
        q_delete(qn)
    truncate("idem.event_outbox", "idem.consumed_events", "billing.dunning")
    q("CHECKPOINT")
    relay = spawn(relay_cmd(), "relay-daemon")
    cons = spawn(consumer_cmd(), "consumer-daemon")
    procs = [relay, cons]
    try:
        wait_for(lambda: q_depth("bench.consumer")["consumers"] >= 1, 30, "consumer ready",
                 procs, 0.2)
        time.sleep(1.0)
        # one event at a time
        out = run_json([PY, os.path.join(HERE, "loadgen.py"), "emit-idle", "--count",
                        str(A.idle_events), "--gap-ms", str(A.idle_gap_ms), "--run", "lat-idle"],
                       120, "loadgen.py emit-idle")
        lat = latency_of("lat-idle", procs)
        RES["latency_idle"] = lat
        log(f"idle latency p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, max "
            f"{lat['max']:.2f} ms over {lat['events']} events (emit -> marked sent: p50 "
            f"{lat['relay_p50']:.2f} ms)")
        # steady rates: the target's, then a higher one with more emitting connections
        for r in range(A.lat_rounds):
            lat = latency_round(f"lat-{r}", A.lat_rate, 4, procs)
            sample("latency", lat)
            out = lat["emitter"]
            if out["achieved_rate"] < 0.95 * A.lat_rate:
                check(f"latency round {r + 1}: the emitter reached only {out['achieved_rate']}/s "
                      f"of {A.lat_rate:.0f}/s")
            log(f"latency round {r + 1} at {out['achieved_rate']:.0f}/s: p50 {lat['p50']:.2f} "
                f"ms, p99 {lat['p99']:.2f} ms, max {lat['max']:.2f} ms (emit -> marked sent: "
                f"p50 {lat['relay_p50']:.2f} ms, p99 {lat['relay_p99']:.2f} ms; "
                f"{lat['relay_transactions']} relay and {lat['consumer_transactions']} consumer "
                "transactions)")
        for r in range(A.lat_rounds if A.lat_rate_high > 0 else 0):
            lat = latency_round(f"lat-hi-{r}", A.lat_rate_high, 8, procs, A.lat_per_tx_high)
            sample("latency_high", lat)
            log(f"latency round {r + 1} at {lat['emitter']['achieved_rate']:.0f}/s (of "
                f"{A.lat_rate_high:.0f}/s, {A.lat_per_tx_high} events a transaction): p50 "
                f"{lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, max {lat['max']:.2f} ms")
        if A.lat_rate_high > 0:
            # the emitter's ceiling with one event per transaction (what bounds it: NOTIFY)
            out = run_json([tool("emit_rate"), "--rate", str(A.lat_rate_high), "--seconds", "2",
                            "--run", "lat-ceiling", "--conns", "16"], 120, "emit_rate")
            RES["emit_ceiling"] = out
            log(f"emitter, one event a transaction on 16 connections: {out['achieved_rate']:.0f}"
                f"/s of {A.lat_rate_high:.0f}/s asked")
            wait_for(lambda: run_consumed("lat-ceiling")[1] >= out["emitted"], 60,
                     "the ceiling run's events applied", procs, 0.1)
        # idle CPU
        time.sleep(2.0)
        c0 = [p.cpu_seconds() for p in procs]
        t = time.monotonic()
        time.sleep(A.idle_cpu_seconds)
        c1 = [p.cpu_seconds() for p in procs]
        secs = time.monotonic() - t
        if None in c0 + c1:
            raise Failure("the relay or the consumer exited while idle")
        for role, a, b in zip(("relay", "consumer"), c0, c1):
            pct = (b - a) / secs * 100
            RES.setdefault("idle_cpu_pct", {})[role] = pct
            log(f"idle CPU {role}: {pct:.3f}% of a core over {secs:.1f}s")
        note_rss("relay", [relay])
        note_rss("consumer", [cons])
    finally:
        for p in procs:
            rc = stop(p)
            if rc != 0:
                check(f"{p.name} exit code after SIGTERM: {rc}")


# ---------------------------------------------------------------------------- phase: claim


def bulk_load_sent(n):
    """n sent rows, fast: the table's indexes are dropped and rebuilt around the load in one
    transaction (the same definitions, read from the catalog)."""
    t = time.monotonic()
    cons = q("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
             "WHERE conrelid = 'idem.event_outbox'::regclass AND contype IN ('p', 'u')")
    idx = q("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'idem' AND "
            "tablename = 'event_outbox' AND indexname NOT IN (SELECT conname FROM "
            "pg_constraint WHERE conrelid = 'idem.event_outbox'::regclass)")
    insert = """
        INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload, status,
                                  attempts, created_at, next_attempt_at, sent_at)
        SELECT md5('sent-' || i)::uuid, s, 'payment.failed',
               jsonb_set(p.j, '{subscription_id}', to_jsonb(s)), 'sent', 1,
               now() - interval '3 days' + i * interval '100 ms',
               now() - interval '3 days' + i * interval '100 ms',
               now() - interval '3 days' + i * interval '100 ms' + interval '5 ms'
          FROM (SELECT jsonb_build_object('invoice_id', gen_random_uuid(),
                       'subscription_id', gen_random_uuid(), 'amount_cents', 4999,
                       'currency', 'EUR', 'reason', 'card_declined', 'bench_run', 'sent') j) p,
               (SELECT i, (%(subs)s::uuid[])[1 + i %% %(nsubs)s] AS s
                  FROM generate_series(1, %(n)s) i) x"""
    args = {"subs": loadgen.SUBSCRIPTIONS[:A.subscriptions], "nsubs": A.subscriptions, "n": n}
    try:
        with DB.connect(autocommit=False) as conn, conn.cursor() as cur:
            cur.execute("SET LOCAL maintenance_work_mem = '256MB'")
            for name, _ in cons:
                cur.execute(f'ALTER TABLE idem.event_outbox DROP CONSTRAINT "{name}"')
            for name, _ in idx:
                cur.execute(f'DROP INDEX idem."{name}"')
            cur.execute(insert, args)
            for name, d in cons:
                cur.execute(f'ALTER TABLE idem.event_outbox ADD CONSTRAINT "{name}" {d}')
            for name, d in idx:
                cur.execute(d)
            conn.commit()
    except psycopg2.Error as e:
        # DB.connect rolled the transaction back
        note(f"fast bulk load failed ({str(e).strip()}); inserting with the indexes in place")
        q(insert, args)
    q("VACUUM ANALYZE idem.event_outbox")
    q("CHECKPOINT")
    log(f"loaded {n} sent rows in {time.monotonic() - t:.1f}s")


CLAIM_STATS_SQL = """
    SELECT calls, total_plan_time + total_exec_time, mean_plan_time + mean_exec_time,
           max_exec_time, rows, query, mean_plan_time, mean_exec_time, plans, total_plan_time
      FROM pg_stat_statements
     WHERE query ILIKE '%event_outbox%' AND query ~* '^\\s*(select|with)'
       AND (query ILIKE '%skip locked%' OR query ILIKE '%pg_try_advisory%lock%')
       AND query NOT ILIKE '%pg_stat_statements%'
     ORDER BY calls DESC, total_exec_time DESC"""


def claim_stats(batches=0):
    """The relay's claim statements as the server saw them (pg_stat_statements, planning +
    execution): its SELECTs on event_outbox that take the candidates' advisory locks or lock
    rows FOR UPDATE SKIP LOCKED. Per claim = their summed time / the claims that found rows:
    the relay's batches (its "batch committed" lines), or without them the fewest calls among
    the statements (a relay before the claim by subscription heads ran its second step on every
    claim that found rows, the heads' claim only when the heads fell short of a batch). An idle
    poll runs the first step only: counted in the sum, which errs on the slow side."""
    rows = q(CLAIM_STATS_SQL)
    stmts = [{"calls": c, "total_ms": t, "mean_ms": m, "mean_plan_ms": mp, "mean_exec_ms": me,
              "max_exec_ms": mx, "rows": rw, "plans": pl, "total_plan_ms": tp,
              "query": " ".join(q.split())[:600]}
             for c, t, m, mx, rw, q, mp, me, pl, tp in rows]
    if not stmts:
        raise Failure("no claim statement (SELECT on event_outbox with SKIP LOCKED or "
                      "pg_try_advisory_xact_lock) in pg_stat_statements")
    claims = batches or min(x["calls"] for x in stmts)
    return {"claims": claims, "per_batch_ms": sum(x["total_ms"] for x in stmts) / claims,
            "statements": stmts}


def client_claim_ms(path, offset):
    """claim_ms of the relay's debug "batch committed" lines (JSON log) after offset."""
    out = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            try:
                o = json.loads(line)
                out.append(float(o["claim_ms"]))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def claim_rounds(label, tag):
    """The claim as a running relay does it (warm connection): a relay daemon (debug JSON log)
    drains a warm-up batch; then --rounds times it is paused (SIGSTOP, while idle),
    --claim-pending rows are emitted (and ANALYZEd: each connection then plans its prepared
    statements again at its next claim; the plannings are counted in the log line), statistics
    reset, and it is resumed (SIGCONT) to drain them in batches of --batch. Returns the median
    over the rounds of the cost per claim."""
    relay = spawn(idem("--log-level", "debug", "--log-format", "json", "relay", "--batch",
                       str(A.batch)) + shlex.split(A.relay_flags), "relay-claim")
    runs = []
    try:
        emit_backlog(A.batch, f"{tag}-warm", checkpoint=False)
        wait_for(lambda: not pending_left(), 60, "warm-up batch", [relay], 0.05)
        for r in range(A.rounds):
            time.sleep(0.5)  # idle: between polls, in no transaction that matters
            relay.pause()
            try:
                emit_backlog(A.claim_pending, f"{tag}-{r}", checkpoint=False)
                q("SELECT pg_stat_statements_reset()")
                offset = os.path.getsize(relay.logpath)
            finally:
                relay.resume()
            wait_for(lambda: not pending_left(), 60, "relay draining the claim backlog",
                     [relay], 0.02)
            cm = client_claim_ms(relay.logpath, offset)
            st = claim_stats(len(cm))
            st["client_claim_ms"] = cm
            runs.append(st)
            log(f"claim ({label}, round {r + 1}): {st['per_batch_ms']:.3f} ms per claim on the "
                f"server over {st['claims']} claims ({len(st['statements'])} statement(s), "
                f"{sum(x['plans'] for x in st['statements'])} plannings taking "
                f"{sum(x['total_plan_ms'] for x in st['statements']):.2f} ms); "
                f"the relay's own claim_ms: "
                f"{statistics.mean(cm) if cm else float('nan'):.1f} over {len(cm)} batches")
    finally:
        rc = stop(relay)
        if rc != 0:
            check(f"relay (claim phase) exit code after SIGTERM: {rc}")
    return {"per_batch_ms": statistics.median(x["per_batch_ms"] for x in runs),
            "rounds": runs}


def phase_claim():
    if not have_idem():
        return
    bind_sink()  # somewhere for the relay's messages to go
    q("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
    q("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
    q("SELECT pg_reload_conf()")
    time.sleep(0.2)
    try:
        truncate("idem.event_outbox")
        RES["claim_base"] = claim_rounds(f"{A.claim_pending} pending, no sent rows", "claim-base")
        truncate("idem.event_outbox")
        bulk_load_sent(A.claim_sent)
        RES["claim_full"] = claim_rounds(f"{A.claim_pending} pending, {A.claim_sent} sent rows",
                                         "claim-full")
    finally:
        q("ALTER SYSTEM SET pg_stat_statements.track = 'none'")
        q("ALTER SYSTEM SET pg_stat_statements.track_planning = off")
        q("SELECT pg_reload_conf()")
        q_delete("bench.sink")
        truncate("idem.event_outbox")


# ---------------------------------------------------------------------------- report


def med(key):
    v = RES["samples"].get(key)
    return statistics.median(v) if v else None


def fmt(v, unit):
    if v is None:
        return "n/a"
    if unit in ("msg/s", "events/s"):
        return f"{v:,.0f} {unit}"
    if unit == "ms":
        return f"{v:.2f} ms"
    if unit == "%":
        return f"{v:.2f} %"
    if unit == "MiB":
        return f"{v:.1f} MiB"
    if unit == "us/event":
        return f"{v:.1f} us/event"
    return f"{v} {unit}"


def build_rows():
    rows = []

    def add(figure, value, unit, base, base_label, base_unit, target, ok_fn, ratio_mode="x"):
        ratio = None
        if value is not None and base:
            ratio = value / base
        # a figure with nothing to compare with (a phase left out by --only) is not judged
        ok = None
        if ok_fn is not None and value is not None and (ratio is not None or ratio_mode != "x"):
            ok = bool(ok_fn(value, ratio))
        rows.append({"figure": figure, "value": value, "unit": unit, "compared_with": base_label,
                     "base": base, "base_unit": base_unit, "ratio": ratio, "target": target,
                     "target_ratio": chart.target_ratio(target, base),
                     "pass": ok, "judged": ok_fn is not None})

    raw, rec = med("raw_publish"), med("recipe_relay")
    r1 = med("relay.1")
    add("raw confirmed publish, the relay's messages", raw, "msg/s", med("raw_publish_v2"),
        "same without BCC, x-idem-seq, user_id (wire v2)", "msg/s", "", None)
    add("relay, 1 process", r1, "msg/s", raw, f"raw confirmed publish, window {A.batch}",
        "msg/s", ">= 0.8x", lambda v, x: x >= 0.8)
    add("relay, 1 process", r1, "msg/s", rec, "recipe relay (Python)", "msg/s", ">= 10x",
        lambda v, x: x >= 10)
    for k in A.relays:
        if k == 2:
            add(f"relay, {k} processes", med(f"relay.{k}"), "msg/s", raw,
                f"raw confirmed publish, window {A.batch}", "msg/s", ">= 0.9x",
                lambda v, x: x >= 0.9)
        elif k != 1:
            add(f"relay, {k} processes", med(f"relay.{k}"), "msg/s", raw,
                f"raw confirmed publish, window {A.batch}", "msg/s", "", None)
    c, dbl, rawc, recc = med("consumer"), med("db_limit"), med("raw_consume"), \
        med("recipe_consumer")
    add("consumer (claim + dunning)", c, "events/s", dbl, "set-based SQL, 100/commit",
        "events/s", ">= 0.8x", lambda v, x: x >= 0.8)
    add("consumer (claim + dunning)", c, "events/s", 15000, "target", "events/s",
        ">= 15,000/s", lambda v, x: v >= 15000)
    add("consumer (claim + dunning)", c, "events/s", rawc, "raw consume + ack (prefetch 200)",
        "msg/s", ">= 0.35x", lambda v, x: x >= 0.35)
    add("consumer (claim + dunning)", c, "events/s", recc, "recipe consumer (Python)",
        "events/s", ">= 10x", lambda v, x: x >= 10)
    lats = RES["samples"].get("latency") or []
    p50 = statistics.median([x["p50"] for x in lats]) if lats else None
    p99 = statistics.median([x["p99"] for x in lats]) if lats else None
    mx = max([x["max"] for x in lats]) if lats else None
    rate = f"{A.lat_rate:,.0f}/s"
    if lats:
        got = statistics.median([x["emitter"]["achieved_rate"] for x in lats])
        if got < 0.95 * A.lat_rate:
            rate += f" (reached {got:,.0f}/s)"
    add(f"latency p50 at {rate}", p50, "ms", 3, "target", "ms", "<= 3 ms",
        lambda v, x: v <= 3)
    add(f"latency p99 at {rate}", p99, "ms", 10, "target", "ms", "<= 10 ms",
        lambda v, x: v <= 10)
    add(f"latency max at {rate}", mx, "ms", None, "", "", "", None)
    hi = RES["samples"].get("latency_high") or []
    if hi:
        rate_hi = f"{A.lat_rate_high:,.0f}/s, {A.lat_per_tx_high} a transaction"
        got = statistics.median([x["emitter"]["achieved_rate"] for x in hi])
        if got < 0.95 * A.lat_rate_high:
            rate_hi += f" (reached {got:,.0f}/s)"
        add(f"latency p50 at {rate_hi}", statistics.median([x["p50"] for x in hi]), "ms", None,
            "", "", "", None)
        add(f"latency p99 at {rate_hi}", statistics.median([x["p99"] for x in hi]), "ms", 25,
            "target", "ms", "<= 25 ms", lambda v, x: v <= 25)
    for conns in (1, 4, 16):
        ei = RES["samples"].get(f"emit.idem.{conns}")
        ep = RES["samples"].get(f"emit.plain.{conns}")
        tgt = (">= 0.9x", lambda v, x: x >= 0.9) if conns == 16 else ("", None)
        add(f"emit, one event a transaction, {conns} connection{'s' if conns > 1 else ''}",
            ei and statistics.median(ei), "events/s", ep and statistics.median(ep),
            "the same row into a plain table", "events/s", *tgt)
    steady = RES.get("steady") or []
    ok = [x for x in steady if x["bounded"]]
    top = max(ok, key=lambda x: x["rate"]) if ok else None
    ei16 = RES["samples"].get("emit.idem.16")
    add(f"steady end to end, highest bounded rate ({A.steady_seconds:.0f} s each)",
        top and top["achieved"], "events/s", ei16 and statistics.median(ei16),
        "emit alone, 16 connections", "events/s", ">= 0.8x", lambda v, x: x >= 0.8)
    for x in steady:
        tg = {1000: ((3, "<= 3 ms"), (10, "<= 10 ms")), 5000: (None, (25, "<= 25 ms"))}.get(
            x["rate"])
        for k, t in zip(("p50", "p99"), tg or (None, None)):
            add(f"steady {x['rate']:,}/s, emit -> effect {k}"
                f"{'' if x['bounded'] else ' (not bounded)'}", x[k], "ms",
                t and t[0], "target" if t else "", "ms" if t else "", t[1] if t else "",
                (lambda v, r, lim=t and t[0]: v <= lim) if t else None)
    ce = RES.get("emit_ceiling")
    if ce:
        add("emitter, one event a transaction, 16 connections", ce["achieved_rate"], "events/s",
            None, "", "", "", None)
    li = RES.get("latency_idle") or {}
    for k in ("p50", "p99", "max"):
        add(f"latency {k} idle (one at a time)", li.get(k), "ms", None, "", "", "", None)
    cpu = RES.get("idle_cpu_pct") or {}
    sec = f"{A.idle_cpu_seconds:.0f} s"
    add(f"idle CPU, relay ({sec})", cpu.get("relay"), "%", 1.0, "target", "%", "< 1%",
        lambda v, x: v < 1.0)
    add(f"idle CPU, consumer ({sec})", cpu.get("consumer"), "%", 1.0, "target", "%", "< 1%",
        lambda v, x: v < 1.0)
    for role in ("relay", "consumer"):
        v = RES["samples"].get(f"rss_kib.{role}")
        add(f"peak RSS, {role} (VmHWM)", max(v) / 1024 if v else None, "MiB", 16, "target",
            "MiB", "< 16 MiB", lambda v, x: v < 16)
    cf, cb = RES.get("claim_full"), RES.get("claim_base")
    add(f"claim per batch, {A.claim_sent:,} sent + {A.claim_pending:,} pending",
        cf and cf["per_batch_ms"], "ms", cb and cb["per_batch_ms"],
        f"same, {A.claim_pending:,} pending and no sent rows", "ms", "<= 2 ms",
        lambda v, x: v <= 2)
    scale.add_rows(sys.modules[__name__], add)
    for row in cost.table(RES, A.relays):  # the cost model: CPU per event (bench/cost.py)
        add(*row)
        rows[-1]["ratio"] = None
    return rows


def render(rows, meta):
    out = ["# idem benchmark", ""]
    out.append(f"{meta['date']} - {meta['host']} - {meta['cpus']} CPUs - load average "
               f"{meta['load_start']} at start, {meta['load_end']} at end - "
               f"{meta['duration_s']:.0f} s")
    out.append("")
    busy = max(float(meta["load_start"].split()[0]), float(meta["load_end"].split()[0]))
    if busy > 0.5 * (meta["cpus"] or 1):
        out.append(f"**Busy machine** (1-minute load average up to {busy:.1f} on "
                   f"{meta['cpus']} CPUs): the figures are noisy; take final ones when it is "
                   "quiet.")
        out.append("")
    out.append("| figure | idem | compared with | its value | ratio | target | result |")
    out.append("|---|---:|---|---:|---:|---|---|")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        res = "" if not r["judged"] else ("n/a" if r["pass"] is None else
                                          ("pass" if r["pass"] else "MISS"))
        base = "" if r["base"] is None else fmt(r["base"], r["base_unit"])
        out.append(f"| {r['figure']} | {fmt(r['value'], r['unit'])} | {r['compared_with']} | "
                   f"{base} | {ratio} | {r['target']} | {res} |")
    out.append("")
    c = meta["config"]
    out.append(f"Durable PostgreSQL ({meta['server'].get('server_version', '?')}: fsync, "
               "synchronous_commit, full_page_writes on), RabbitMQ quorum queues, persistent "
               "mandatory messages with publisher confirms, all on this machine.")
    out.append(f"Throughputs: medians of {c['rounds']} round(s) of {c['events']:,} events over "
               f"{c['subscriptions']} subscriptions, from commit timestamps; relay batch "
               f"{c['batch']}. The recipe (bench/recipe.py) rounds are capped at "
               f"{c['recipe_seconds']:g} s. Latency: emit -> consumer commit, medians of "
               f"{c['lat_rounds']} round(s) of {c['lat_seconds']:g} s at {c['lat_rate']:g}/s "
               f"(max over all); idle: {c['idle_events']} events {c['idle_gap_ms']:g} ms apart.")
    if meta.get("chart"):
        out.append("")
        out.append(f"![each figure as a ratio to its limit]({meta['chart']})")
        out.append("")
    for n in RES["notes"]:
        out.append(f"- note: {n}")
    for n in RES["checks"]:
        out.append(f"- check: {n}")
    for e in RES["errors"]:
        out.append(f"- ERROR: {e}")
    return "\n".join(out) + "\n"


def load_avg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def write_results(rows, meta):
    """latest.svg (the chart), latest.md and latest.json in A.out."""
    doc = {"meta": meta, "rows": rows, "samples": RES["samples"],
           "latency_idle": RES.get("latency_idle"), "idle_cpu_pct": RES.get("idle_cpu_pct"),
           "claim_base": RES.get("claim_base"), "claim_full": RES.get("claim_full"),
           "cost": RES.get("cost"),
           "scale": RES.get("scale"),
           "notes": RES["notes"], "checks": RES["checks"], "errors": RES["errors"]}
    os.makedirs(A.out, exist_ok=True)
    svg = os.path.join(A.out, "latest.svg")
    try:
        chart.draw(json.loads(json.dumps(doc, default=str)), svg + ".tmp")
        os.replace(svg + ".tmp", svg)
        meta["chart"] = "latest.svg"
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        log(f"chart not drawn: {e}")
    md = render(rows, meta)
    for name, text in (("latest.md", md), ("latest.json", json.dumps(doc, indent=2,
                                                                      default=str) + "\n")):
        tmp = os.path.join(A.out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(A.out, name))
    return md


def redraw_chart(path):
    """--chart JSON: draws the chart of an earlier run beside its results file."""
    with open(path) as f:
        doc = json.load(f)
    svg = os.path.join(os.path.dirname(os.path.abspath(path)),
                       os.path.splitext(os.path.basename(path))[0] + ".svg")
    try:
        chart.draw(doc, svg)
    except RuntimeError as e:
        sys.exit(f"bench: {e}")
    print(svg)
    return 0


def start_servers():
    """The servers to measure on: --external's, or private durable ones in a new temporary
    directory (returned, to be removed at the end)."""
    global SERVERS
    if A.external:
        SERVERS = H.servers_from_env()
        if SERVERS is None:
            sys.exit("bench: --external needs IDEM_PG_URL and IDEM_AMQP_URL (and IDEM_SVC_DIR)")
        return None
    work = tempfile.mkdtemp(prefix="idem-bench.")
    os.chmod(work, 0o755)  # user postgres must reach the data directory below it
    t = time.monotonic()
    try:
        SERVERS = H.start_servers(work, durable=True)
    except RuntimeError as e:
        H.stop_servers(work, quiet=True)
        shutil.rmtree(work, ignore_errors=True)
        sys.exit(f"bench: {e}")
    log(f"servers up in {time.monotonic() - t:.0f} s ({work})")
    return work


def main():
    global A, DB, BROKER
    A = parse_args()
    if A.chart:
        return redraw_chart(A.chart)
    if not A.external and os.geteuid() != 0:
        sys.exit("bench: must run as root (scripts/services.sh runs PostgreSQL through runuser)")
    H.IDEM = A.idem
    r = subprocess.run(["make", "-s", "-C", HERE, "tools", f"OUT={A.tools}"],
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        sys.exit("bench: building the tools (bench/Makefile) failed")
    if not have_idem():
        log(f"warning: {A.idem} not built; only the limits and the recipe will be measured")

    def on_term(sig, frame):
        raise KeyboardInterrupt(f"signal {sig}")
    signal.signal(signal.SIGTERM, on_term)

    work = None
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "cpus": os.cpu_count(), "load_start": load_avg(),
            "idem": A.idem, "have_idem": None}
    phases = [("relay", phase_relay), ("consumer", phase_consumer), ("emit", phase_emit),
              ("steady", phase_steady),
              ("latency", phase_latency), ("claim", phase_claim),
              ("scale-consumer", lambda: scale.phase_consumer(sys.modules[__name__])),
              ("scale-cluster", lambda: scale.phase_cluster(sys.modules[__name__]))]
    try:
        work = start_servers()
        SERVERS.export()  # the tools (loadgen.py, recipe.py, raw_*, emit_rate) read them
        if not A.logs:
            A.logs = os.path.join(work or SERVERS.svc_dir or tempfile.gettempdir(),
                                  "bench-logs")
        os.makedirs(A.logs, exist_ok=True)
        log(f"load average {meta['load_start']}; logs in {A.logs}")
        DB = H.Db(SERVERS.pg_url, keep=True, application_name="idem-bench")
        BROKER = H.Broker(SERVERS.amqp_url)
        setup_server()
        migrate()
        meta["have_idem"] = have_idem()
        if not have_idem():
            RES["errors"].append(f"{A.idem} missing: idem's figures not measured")
        for name, fn in phases:
            if A.only and name not in A.only:
                continue
            log(f"--- {name}")
            try:
                fn()
            except Failure as e:
                log(f"{name} failed: {e}")
                RES["errors"].append(f"{name}: {e}")
                stop_all()
        meta["load_end"] = load_avg()
        meta["duration_s"] = time.monotonic() - T0
        meta["server"] = RES.get("server", {})
        meta["config"] = {k: v for k, v in vars(A).items()
                          if k not in ("only", "chart", "keep", "external")}
        md = write_results(build_rows(), meta)
        print(md)
        log(f"wrote {os.path.join(A.out, 'latest.md')}, latest.json and "
            f"{meta.get('chart', 'no chart')} in {meta['duration_s']:.0f}s")
        return 1 if RES["errors"] else 0
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all()
        if DB is not None:
            DB.close()
        if work:
            H.stop_servers(work, quiet=True)
            if A.keep:
                log(f"kept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
