"""scale.py - bench.py's scale-out phases: a partitioned consumer group at P = 1, 2, 4 processes,
and one relay against a 3-node RabbitMQ cluster beside the single node.

bench.py registers both phases (`--only scale` selects both; `scale-consumer`, `scale-cluster`
one each), their knobs (add_args) and their rows (add_rows); everything else is here. The
functions take bench.py's module (B) to use its servers, helpers and results.

scale-consumer
    Per round: --scale-events billing events (payment.failed, and invoice.paid as every fifth
    event of a subscription) over --subscriptions subscriptions, emitted with idem_emit, are
    relayed by one `idem relay` into every group at once: the plain queue bench.group1 (P = 1,
    `idem consume --queue bench.group1`, the setup of the consumer phase) and the partitioned
    groups bench.group<P> (`--partitions P`: the direct exchange bench.group<P>.part routing the
    relay's shard keys, quorum queues bench.group<P>.p<i> with single active consumer),
    each declared by `idem consume` itself beforehand. Then each group drains the same backlog
    in turn (the order rotates per round), from the same database state (ledger and billing
    tables emptied, CHECKPOINT): P processes, process i given `--partition i`. Rate = commit
    timestamps of the group's ledger rows, as for the consumer phase. Checked per drain: every
    event applied once, nothing dead-lettered or left, and each subscription's final dunning step
    equal to its events applied in emit order (payment.failed and invoice.paid do not commute).

scale-cluster
    A 3-node RabbitMQ cluster (scripts/services.sh start DIR --rmq-nodes 3, inside the run's
    directory; its own PostgreSQL is stopped at once, unused) beside the run's single node. Per
    round, for each broker (the order alternates): --scale-events pending payment.failed rows
    (the relay phase's backlog) drained by one `idem relay --batch B` into bench.sink (declared
    by `idem consume`: a quorum queue, on the cluster replicated to all 3 nodes), the relay given
    `--amqp` = the single node's URL or the cluster's comma-separated URL list. Rate from the
    commit timestamps of the sent marks, as for the relay phase.

Both record, per drain, the CPU time of idem's processes (the harness's /proc accounting), of
PostgreSQL (the postmaster and its children), of RabbitMQ (each node's beam and children), of
the whole machine (/proc/stat; what none of these used is other load), PostgreSQL's WAL
flushes (pg_stat_wal, with track_wal_io_timing on for the phase), the group's transactions, and
the measured daemons' own "batch committed" lines (they run with --log-level debug --log-format
json): a consumer's transaction times, the relay's claim / publish / confirm wait / mark split.
What bounds the figures is in the notes and in latest.json ("scale").
"""
import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time

import idem_harness as H

PHASES = ("scale-consumer", "scale-cluster")
GROUP_CONSUMER = "scale"  # the ledger name of every group (its rows are removed between drains)
SINK = "bench.sink"
EMIT_MIXED_SQL = """
    SELECT count(idem.idem_emit(CASE WHEN (i / %(nsubs)s) %% 5 = 2 THEN 'invoice.paid'
                                ELSE 'payment.failed' END,
                           s, %(run)s || '-' || i,
                           jsonb_build_object('invoice_id', gen_random_uuid(),
                                              'subscription_id', s, 'amount_cents', 4999,
                                              'currency', 'EUR', 'reason', 'card_declined',
                                              'bench_run', %(run)s)))
      FROM (SELECT i, (%(subs)s::uuid[])[1 + i %% %(nsubs)s] AS s
              FROM generate_series(0, %(n)s - 1) i
             WHERE i %% %(parts)s = %(part)s) x"""
# each subscription's dunning step after its events applied in emit (seq) order: the
# payment.failed events after its last invoice.paid
EXPECT_SQL = """
    INSERT INTO bench_scale_expect (subscription_id, step, paid)
    SELECT subscription_id,
           count(*) FILTER (WHERE event_type = 'payment.failed' AND seq > coalesce(last_paid, 0)),
           count(*) FILTER (WHERE event_type = 'invoice.paid')
      FROM (SELECT subscription_id, event_type, seq,
                   max(seq) FILTER (WHERE event_type = 'invoice.paid')
                       OVER (PARTITION BY subscription_id) AS last_paid
              FROM idem.event_outbox WHERE payload ->> 'bench_run' = %s) e
     GROUP BY subscription_id"""


# ---------------------------------------------------------------------------- bench.py hooks


def add_args(ap):
    ap.add_argument("--scale-events", type=int, default=_env_int("BENCH_SCALE_EVENTS", 30000),
                    help="backlog of the scale phases: billing events drained by each consumer "
                         "group, pending rows drained by the relay on each broker")
    ap.add_argument("--scale-partitions", default=os.environ.get("BENCH_SCALE_PARTITIONS",
                                                                 "1,2,4"),
                    help="the groups of the scale-consumer phase: P processes, one per partition "
                         "(1 = one process on a plain queue)")
    ap.add_argument("--scale-nodes", type=int, default=_env_int("BENCH_SCALE_NODES", 3),
                    help="RabbitMQ nodes of the scale-cluster phase's cluster")
    ap.add_argument("--scale-rounds", type=int, default=_env_int("BENCH_SCALE_ROUNDS", 0),
                    help="rounds of the scale phases (default: --rounds)")


def finish_args(a):
    """After parsing: --quick sizes, lists parsed, `scale` in --only meaning both phases."""
    if a.quick:
        a.scale_events = min(a.scale_events, 5000)
        a.scale_rounds = 1
    if a.scale_rounds <= 0:
        a.scale_rounds = a.rounds
    a.scale_partitions = [int(x) for x in a.scale_partitions.replace(" ", ",").split(",") if x]
    if "scale" in a.only:
        a.only |= set(PHASES)


def _env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def add_rows(B, add):
    """The phases' rows in bench.py's table (through its add()): P > 1 against P = 1, the cluster
    against the single node; no targets (grey in the chart)."""
    ps = B.A.scale_partitions
    base = B.med("scale.consumer.1") if 1 in ps else None
    for p in ps:
        fig = (f"consumer group P={p} ({p} process{'es' if p > 1 else ''}"
               f"{', plain queue' if p == 1 else ', one partition each'})")
        if p == 1:
            add(fig, B.med("scale.consumer.1"), "events/s", None, "", "", "", None)
        else:
            add(fig, B.med(f"scale.consumer.{p}"), "events/s", base, "P=1, 1 process",
                "events/s", "", None)
    single = B.med("scale.relay.single")
    add("relay, 1 process, single RabbitMQ node", single, "msg/s", None, "", "", "", None)
    add(f"relay, 1 process, {B.A.scale_nodes}-node RabbitMQ cluster",
        B.med("scale.relay.cluster"), "msg/s", single, "single node, same backlog", "msg/s", "",
        None)


# ---------------------------------------------------------------------------- CPU accounting


def _stat(pid):
    """(ppid, utime + stime, cutime + cstime) in seconds from /proc/PID/stat, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
    except OSError:
        return None
    rest = st[st.rindex(")") + 2:].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / tck, \
        (int(rest[13]) + int(rest[14])) / tck


def _children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(d)
            if s is not None:
                kids.setdefault(s[0], []).append(int(d))
    return kids


def tree_cpu(roots, kids=None):
    """CPU seconds of the processes roots and all their descendants (the harness's
    proc_cpu_seconds of each), plus what their children that exited used (cutime + cstime of
    each process in the tree): a server's CPU so far, including backends that came and went."""
    kids = _children_map() if kids is None else kids
    total, seen, todo = 0.0, set(), [r for r in roots if r]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        own = H.proc_cpu_seconds(pid)
        s = _stat(pid)
        if own is None or s is None:
            continue
        total += own + s[2]
        todo.extend(kids.get(pid, []))
    return total


def _pidfile(path):
    try:
        with open(path) as f:
            return int(f.readline().strip())
    except (OSError, ValueError):
        return None


def pg_pids(svc_dir):
    return [_pidfile(os.path.join(svc_dir, "pg", "data", "postmaster.pid"))] if svc_dir else []


def rmq_pids(svc_dir, nodes=1):
    if not svc_dir:
        return []
    r = os.path.join(svc_dir, "rmq")
    return [_pidfile(os.path.join(r if k == 1 else os.path.join(r, f"node{k}"), "beam.pid"))
            for k in range(1, nodes + 1)]


def machine_cpu():
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat; idle and iowait are
    not busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return (total - v[3] - v[4]) / tck, total / tck


class Meter:
    """CPU and WAL accounting of one drain of n events: start() just before the processes start,
    stop() when the work is done (before stopping them), wal() once they are stopped. idem's
    processes are read at stop() (their CPU since they started); the servers and the machine
    as differences; pg_stat_wal once the processes' backends exited, since a backend publishes
    its WAL statistics at most once a second, and at exit."""

    def __init__(self, B, procs, pg_roots, rmq_roots, n, idle_roots=()):
        self.B, self.procs, self.pg_roots, self.rmq_roots = B, procs, pg_roots, rmq_roots
        self.n, self.idle_roots = n, idle_roots  # idle_roots: the broker not used meanwhile

    def _servers(self):
        kids = _children_map()
        return (tree_cpu(self.pg_roots, kids), tree_cpu(self.rmq_roots, kids),
                tree_cpu(self.idle_roots, kids))

    def _wal(self):
        self.B.q("SELECT pg_stat_force_next_flush()")  # this session's own share, first
        return self.B.q("SELECT wal_write, wal_sync, wal_sync_time, wal_bytes FROM pg_stat_wal")[0]

    def start(self):
        self.w0 = self._wal()
        self.t0 = time.monotonic()
        self.m0 = machine_cpu()
        self.s0 = self._servers()
        self.self0 = sum(os.times()[:2])
        return self

    def stop(self):
        self.wall = wall = time.monotonic() - self.t0
        idem = sum(p.cpu_seconds() or 0.0 for p in self.procs)
        s1, m1 = self._servers(), machine_cpu()
        me = sum(os.times()[:2]) - self.self0
        busy, total = m1[0] - self.m0[0], m1[1] - self.m0[1]
        pg, rmq, idle = (s1[i] - self.s0[i] for i in range(3))
        ncpu = os.cpu_count() or 1
        per = {"idem": idem, "postgresql": pg, "rabbitmq": rmq}
        us = {k: v / self.n * 1e6 for k, v in per.items()} if self.n else None
        cores = {"idem": idem / wall, "postgresql": pg / wall, "rabbitmq": rmq / wall,
                 "bench": me / wall,
                 "other": max(0.0, busy - idem - pg - rmq - me - idle) / wall}
        if self.idle_roots:
            cores["idle_broker"] = idle / wall
        return {"wall_s": wall,
                "cores": cores,
                "cpu_us_per_event": us,
                # the rate at which idem, PostgreSQL and RabbitMQ alone would keep every CPU
                # busy, at the CPU cost per event measured
                "cpu_ceiling_rate": ncpu * 1e6 / sum(us.values()) if us and sum(us.values())
                else None,
                "machine_busy_pct": 100.0 * busy / total if total > 0 else None,
                "cpus": ncpu}

    def wal(self):
        """pg_stat_wal over the drain: call once the processes stopped (waits until their
        backends are gone, at most 10 s)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.B.one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid()"):
            time.sleep(0.05)
        w1 = self._wal()
        syncs = int(w1[1] - self.w0[1])
        sync_ms = float(w1[2] - self.w0[2])
        return {"wal_syncs": syncs, "wal_writes": int(w1[0] - self.w0[0]),
                "wal_bytes": int(w1[3] - self.w0[3]),
                "wal_sync_busy_pct": 100.0 * sync_ms / 1000.0 / self.wall,
                "wal_sync_ms_mean": sync_ms / syncs if syncs else None}


def _cores_text(m):
    c, us = m["cores"], m.get("cpu_us_per_event") or {}
    idle = f", the other (idle) broker {c['idle_broker']:.2f}" if "idle_broker" in c else ""
    text = (f"idem {c['idem']:.2f}, PostgreSQL {c['postgresql']:.2f}, RabbitMQ "
            f"{c['rabbitmq']:.2f}{idle}, other load {c['other']:.2f} cores, machine "
            f"{m['machine_busy_pct']:.0f}% busy of {m['cpus']} CPUs")
    if us:
        text += (f"; CPU per event: idem {us['idem']:.0f} us, PostgreSQL {us['postgresql']:.0f} "
                 f"us, RabbitMQ {us['rabbitmq']:.0f} us (all {m['cpus']} CPUs busy at "
                 f"{m['cpu_ceiling_rate']:,.0f}/s)")
    return text


def _steps_text(b):
    if not b or not b.get("batches"):
        return "no batch timings"
    return ("a batch (median ms): claim {claim_ms:.1f}, publish {publish_ms:.1f}, confirm wait "
            "{confirm_wait_ms:.1f}, mark + commit {mark_commit_ms:.1f}").format(**b)


def _median_meter(ms):
    """The per-drain accounting, each number the median over the drains."""
    if not ms:
        return None
    keys = [k for k, v in ms[0].items() if isinstance(v, (int, float)) and k != "cpus"]
    out = {k: statistics.median(m[k] for m in ms if m.get(k) is not None)
           if any(m.get(k) is not None for m in ms) else None for k in keys}
    for sub in ("cores", "cpu_us_per_event", "batch"):
        if ms[0].get(sub):
            out[sub] = {}
            for k in ms[0][sub]:
                v = [m[sub][k] for m in ms if (m.get(sub) or {}).get(k) is not None]
                out[sub][k] = statistics.median(v) if v else None
    out["cpus"] = ms[0]["cpus"]
    return out


# ---------------------------------------------------------------------------- daemons' logs

DEBUG_JSON = ["--log-level", "debug", "--log-format", "json"]  # one line per batch committed


def _spawn_logged(B, argv, name):
    """B.spawn with the offset of the new process's lines in its (appended) log file."""
    path = os.path.join(B.A.logs, name + ".log")
    offset = os.path.getsize(path) if os.path.exists(path) else 0
    return B.spawn(argv, name), offset


def _log_lines(d, offset):
    """The JSON lines a daemon (spawned with DEBUG_JSON) logged after offset."""
    out = []
    with open(d.logpath, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def _consumer_batches(lines, wall):
    """From a consumer's "batch committed" lines (applied, ms from the batch's start to its
    commit): batches, median ms, and the share of the drain spent inside transactions."""
    ms = [float(o["ms"]) for o in lines if o.get("msg") == "batch committed" and "ms" in o]
    return {"batches": len(ms), "batch_ms_median": statistics.median(ms) if ms else None,
            "in_transaction_pct": 100.0 * sum(ms) / 1000.0 / wall if wall else None}


RELAY_STEPS = ("claim_ms", "publish_ms", "confirm_wait_ms", "mark_commit_ms")


def _relay_batches(lines):
    """From the relay's "batch committed" lines: batches, and the median of each step's ms."""
    bs = [o for o in lines if o.get("msg") == "batch committed" and "confirm_wait_ms" in o]
    out = {"batches": len(bs)}
    for k in RELAY_STEPS:
        v = [float(o[k]) for o in bs if k in o]
        out[k] = statistics.median(v) if v else None
    return out


# ---------------------------------------------------------------------------- topology


def _svc_env():
    # an instance of its own picks free ports (the run's env may name the run's servers' ports)
    return {k: v for k, v in os.environ.items() if k not in ("IDEM_PG_PORT", "IDEM_AMQP_PORT")}


def declare(B, queue, amqp_url, args=(), partitions=1, check_url=None):
    """Has `idem consume` declare its topology for queue (P = partitions) on amqp_url (one URL or
    a list), waits until it consumes every queue of it, stops it."""
    qs = [queue] if partitions == 1 else [f"{queue}.p{i}" for i in range(partitions)]
    argv = B.idem("--amqp", amqp_url, "consume", "--consumer", "bench-declare", "--queue", queue,
                  *(["--partitions", str(partitions)] if partitions > 1 else []), *args) + \
        shlex.split(B.A.consumer_flags)
    d = B.spawn(argv, f"declare-{queue}")
    try:
        H.wait_for_consumers(H.Broker(check_url or amqp_url), qs, 1, [d], 60)
    except AssertionError as e:
        raise B.Failure(f"declaring {queue}: {e}") from None
    finally:
        rc = B.stop(d)
    if rc != 0:
        raise B.Failure(f"idem consume declaring {queue} exited {rc} on SIGTERM")
    return qs


def delete_group(broker, queue, partitions):
    """Deletes a group's queues (QUEUE or QUEUE.p*, QUEUE.dlq) and exchanges (.part, .dlx, ...)."""
    for qn in [queue, queue + ".dlq"] + [f"{queue}.p{i}" for i in range(partitions)]:
        broker.delete_queue(qn)
    for x in (queue + ".part", queue + ".part.unkeyed", queue + ".hash", queue + ".dlx"):
        try:
            with broker.channel() as ch:
                ch.exchange_delete(exchange=x)
        except Exception:
            pass


# ---------------------------------------------------------------------------- scale-consumer


def _emit_mixed(B, n, run):
    """n billing events through idem_emit, two transactions on disjoint halves of the
    subscriptions (as bench.emit_backlog)."""
    import threading
    t = time.monotonic()
    nsubs = B.A.subscriptions
    parts = 2 if nsubs % 2 == 0 else 1
    args = {"run": run, "subs": B.loadgen.SUBSCRIPTIONS[:nsubs], "nsubs": nsubs, "n": n,
            "parts": parts}
    errors = []

    def part(k):
        try:
            with H.Db(B.SERVERS.pg_url).connect(autocommit=False) as c, c.cursor() as cur:
                cur.execute(EMIT_MIXED_SQL, dict(args, part=k))
                c.commit()
        except Exception as e:
            errors.append(e)

    th = [threading.Thread(target=part, args=(k,)) for k in range(parts)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    if errors:
        raise B.Failure(f"emitting the billing backlog: {errors[0]}")
    B.q("ANALYZE idem.event_outbox")
    B.log(f"emitted {n} billing events ({run}) in {time.monotonic() - t:.1f}s")


def _reset_state(B):
    """The database as before a drain: no ledger rows, no billing effects, no outbox rows or
    emitted keys (invoice.paid emits receipt.requested: each drain emits them anew)."""
    B.truncate("idem.consumed_events", "billing.dunning", "billing.revenue_entries",
               "billing.receipts", "idem.event_outbox", "idem.idem_emitted_keys")
    B.q("CHECKPOINT")


def _group_cmd(p, i):
    return ["consume", "--consumer", GROUP_CONSUMER, "--queue", f"bench.group{p}"] + \
        (["--partitions", str(p), "--partition", str(i)] if p > 1 else [])


def _drain(B, p, n, paid, r):
    """Group P drains its queues (filled); returns the drain's record."""
    _reset_state(B)
    amqp = B.SERVERS.amqp_url
    spawned = [_spawn_logged(B, B.idem("--amqp", amqp, *DEBUG_JSON, *_group_cmd(p, i)) +
                             shlex.split(B.A.consumer_flags), f"group{p}-{i}") for i in range(p)]
    procs = [d for d, _ in spawned]
    meter = Meter(B, procs, pg_pids(B.SERVERS.svc_dir), rmq_pids(B.SERVERS.svc_dir), n).start()
    try:
        B.wait_for(lambda: B.one("SELECT count(*) FROM idem.consumed_events WHERE consumer = %s",
                                 (GROUP_CONSUMER,)) >= n,
                   max(120, n / 200), f"group P={p} draining", procs, 0.05)
        m = meter.stop()
        rss = [p_.peak_rss_kib() for p_ in procs]
    finally:
        rcs = [B.stop(x) for x in procs]
    if any(rc != 0 for rc in rcs):
        B.check(f"scale round {r + 1}, P={p}: exit codes after SIGTERM {rcs}")
    m.update(meter.wal())
    m["per_process"] = [_consumer_batches(_log_lines(d, off), m["wall_s"]) for d, off in spawned]
    rate, rows, span = B.commit_rate("idem.consumed_events", "consumer = %s", (GROUP_CONSUMER,))
    txs = B.one("SELECT count(DISTINCT xmin::text) FROM idem.consumed_events WHERE consumer = %s",
                (GROUP_CONSUMER,))
    wrong = B.one("SELECT count(*) FROM bench_scale_expect x LEFT JOIN billing.dunning d "
                  "USING (subscription_id) WHERE d.step IS DISTINCT FROM x.step")
    revenue = B.one("SELECT count(*) FROM billing.revenue_entries")
    queues = [f"bench.group{p}"] if p == 1 else [f"bench.group{p}.p{i}" for i in range(p)]
    infos = B.BROKER.queue_infos(queues + [f"bench.group{p}.dlq"])
    left = sum(infos[x][0] for x in queues if infos[x])
    dlq = (infos[f"bench.group{p}.dlq"] or (0, 0))[0]
    if rows != n or wrong or revenue != paid or left or dlq:
        B.check(f"scale round {r + 1}, P={p}: applied {rows} of {n}, {wrong} subscription(s) "
                f"whose dunning step differs from emit order, {revenue} revenue entries for "
                f"{paid} invoice.paid, {left} left in the queues, {dlq} dead-lettered")
    m.update({"partitions": p, "processes": p, "round": r + 1, "rate": rate, "events": rows,
              "span_s": span, "transactions": txs, "events_per_tx": rows / txs if txs else None,
              "order_mismatches": wrong, "peak_rss_kib": rss})
    B.sample(f"scale.consumer.{p}", rate)
    m["in_transaction_pct"] = statistics.median(x["in_transaction_pct"] or 0
                                                for x in m["per_process"])
    m["batch_ms_median"] = statistics.median(x["batch_ms_median"] or 0 for x in m["per_process"])
    B.log(f"scale round {r + 1}: P={p} {rate:.0f} events/s over {rows} events in {txs} "
          f"transactions; {_cores_text(m)}; WAL fsync busy {m['wal_sync_busy_pct']:.0f}% "
          f"({m['wal_syncs']} fsyncs); a process in a transaction "
          f"{m['in_transaction_pct']:.0f}% of the time, {m['batch_ms_median']:.1f} ms a batch")
    return m


def phase_consumer(B):
    """scale-consumer (see the module docstring)."""
    if not B.have_idem():
        return
    A, n, ps = B.A, B.A.scale_events, B.A.scale_partitions
    res = B.RES.setdefault("scale", {})
    res["consumer"] = {"events": n, "subscriptions": A.subscriptions, "partitions": ps,
                       "drains": [], "partition_sizes": []}
    for qn in ("bench.consumer", "bench.sink", "bench.raw", "bench.recipe"):
        B.q_delete(qn)  # nothing else bound to the exchange: the relay fills only the groups
    for p in ps:
        delete_group(B.BROKER, f"bench.group{p}", p)
    B.q("DROP TABLE IF EXISTS bench_scale_expect")
    B.q("CREATE TABLE bench_scale_expect (subscription_id uuid PRIMARY KEY, step int, paid int)")
    _wal_timing(B, True)
    try:
        took = []
        for p in ps:
            t0 = time.monotonic()
            declare(B, f"bench.group{p}", B.SERVERS.amqp_url, partitions=p)
            took.append(f"P={p} {time.monotonic() - t0:.1f} s")
        # what the 1,024 shard bindings of a partitioned group cost when a process starts
        B.note("scale declare: from `idem consume` started to consuming every queue of its group "
               "(first start, nothing declared yet): " + ", ".join(took))
        for r in range(A.scale_rounds):
            _reset_state(B)
            B.truncate("bench_scale_expect")
            run = f"scale-r{r}"
            _emit_mixed(B, n, run)
            B.q(EXPECT_SQL, (run,))
            paid = B.one("SELECT sum(paid) FROM bench_scale_expect")
            relay = B.spawn(B.relay_cmd(), "scale-fill-relay")
            try:
                B.wait_for(lambda: not B.pending_left(), max(120, n / 300),
                           "the relay filling the groups", [relay], 0.1)
            finally:
                B.stop(relay)
            sizes = {}
            for p in ps:
                qs = [f"bench.group{p}"] if p == 1 else [f"bench.group{p}.p{i}" for i in range(p)]
                infos = B.BROKER.queue_infos(qs)
                sizes[p] = [infos[x][0] if infos[x] else -1 for x in qs]
                if sum(sizes[p]) != n:
                    B.check(f"scale round {r + 1}: group P={p} holds {sum(sizes[p])} messages "
                            f"for {n} events ({sizes[p]})")
            res["consumer"]["partition_sizes"].append({str(k): v for k, v in sizes.items()})
            B.log(f"scale round {r + 1}: relayed {n} events into every group; partition "
                  f"sizes {sizes}")
            k = r % len(ps)
            for p in ps[k:] + ps[:k]:  # the order rotates: no group always drains first
                res["consumer"]["drains"].append(_drain(B, p, n, paid, r))
    finally:
        _wal_timing(B, False)
        for p in ps:
            delete_group(B.BROKER, f"bench.group{p}", p)
        B.q("DROP TABLE IF EXISTS bench_scale_expect")
        _reset_state(B)
    by = {p: _median_meter([d for d in res["consumer"]["drains"] if d["partitions"] == p])
          for p in ps}
    res["consumer"]["median"] = {str(p): v for p, v in by.items()}
    base = B.med("scale.consumer.1")
    B.note(f"scale-consumer: {n:,} billing events (payment.failed, every fifth of a subscription "
           f"invoice.paid) over {A.subscriptions} subscriptions, relayed into every group, then "
           f"drained by each group in turn; medians of {A.scale_rounds} round(s); figures from "
           "the group's commit timestamps, CPU and WAL over each drain")
    for p in ps:
        m, rate = by[p], B.med(f"scale.consumer.{p}")
        if m is None or rate is None:
            continue
        ratio = f" ({rate / base:.2f}x P=1)" if base and p != 1 else ""
        B.note(f"scale P={p}: {rate:,.0f} events/s{ratio}; during the drain (medians): "
               f"{_cores_text(m)}; {m['events_per_tx']:.0f} events per transaction, "
               f"{m['batch_ms_median']:.1f} ms each, a process inside one "
               f"{m['in_transaction_pct']:.0f}% of the time; WAL fsyncs "
               f"{m['wal_syncs'] / m['wall_s']:.0f}/s, busy {m['wal_sync_busy_pct']:.0f}% of "
               f"the time ({m['wal_sync_ms_mean'] or 0:.2f} ms each)")


def _wal_timing(B, on):
    """track_wal_io_timing for the phase (pg_stat_wal's wal_sync_time), then back as it was."""
    if on:
        B.q("ALTER SYSTEM SET track_wal_io_timing = on")
    else:
        B.q("ALTER SYSTEM RESET track_wal_io_timing")
    B.q("SELECT pg_reload_conf()")
    time.sleep(0.2)


# ---------------------------------------------------------------------------- scale-cluster


class Cluster:
    """A RabbitMQ cluster of its own (scripts/services.sh start DIR --rmq-nodes N), its
    PostgreSQL stopped; always stopped and removed by stop()."""

    def __init__(self, base, nodes):
        self.nodes = nodes
        self.dir = tempfile.mkdtemp(prefix="rmq-cluster.", dir=base)
        os.chmod(self.dir, 0o755)
        self.env = {}

    def services(self, *args, timeout=300):
        r = subprocess.run([H.SERVICES, args[0], self.dir, *args[1:]], capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=_svc_env())
        if r.returncode != 0:
            raise RuntimeError(f"services.sh {' '.join(args)} failed ({r.returncode}): "
                               f"{r.stderr.strip()[-1500:]}")
        return r.stdout

    def start(self):
        path = self.services("start", "--rmq-nodes", str(self.nodes)).strip()
        with open(path) as f:
            for line in f:
                for word in shlex.split(line, comments=True):
                    if word != "export" and "=" in word:
                        k, v = word.split("=", 1)
                        self.env[k] = v
        self.services("pg-stop")  # only its RabbitMQ nodes are used
        return self

    @property
    def urls(self):
        return self.env["IDEM_AMQP_URLS"]

    def url(self, k=1):
        return self.urls.split(",")[k - 1]

    def leader(self, queue):
        return int(self.services("rmq-leader", queue).strip())

    def members(self, queue):
        out = self.services("rmqctl", "-q", "list_queues", "name", "type", "members",
                            "--no-table-headers")
        for line in out.splitlines():
            if line.split() and line.split()[0] == queue:
                return " ".join(line.split()[2:])
        return None

    def stop(self):
        if self.dir is None:
            return
        try:
            subprocess.run([H.SERVICES, "stop", self.dir], capture_output=True, timeout=180,
                           stdin=subprocess.DEVNULL, env=_svc_env())
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _relay_drain(B, label, amqp, broker, rmq_roots, idle_roots, n, r):
    B.truncate("idem.event_outbox")
    B.emit_backlog(n, f"scale-{label}-r{r}")
    broker.purge_queue(SINK)
    relay, offset = _spawn_logged(B, B.relay_cmd() + ["--amqp", amqp] + DEBUG_JSON,
                                  f"scale-relay-{label}")
    meter = Meter(B, [relay], pg_pids(B.SERVERS.svc_dir), rmq_roots, n, idle_roots).start()
    try:
        B.wait_for(lambda: not B.pending_left(), max(120, n / 300), f"relay draining ({label})",
                   [relay], 0.05)
        m = meter.stop()
        B.note_rss("relay", [relay])
    finally:
        rc = B.stop(relay)
    if rc != 0:
        B.check(f"scale relay ({label}) exit code after SIGTERM: {rc}")
    m.update(meter.wal())
    lines = _log_lines(relay, offset)
    m["batch"] = _relay_batches(lines)
    server = [o.get("server") for o in lines
              if o.get("msg", "").startswith("connected to RabbitMQ")]
    rate, rows, span = B.commit_rate("idem.event_outbox", "status = 'sent'")
    info = broker.queue_info(SINK)
    depth = info[0] if info else -1
    if rows != n or depth != n:
        B.check(f"scale round {r + 1}, relay ({label}): {rows} rows sent, {depth} messages in "
                f"{SINK}, for {n} events")
    B.sample(f"scale.relay.{label}", rate)
    m.update({"broker": label, "round": r + 1, "rate": rate, "rows": rows, "span_s": span,
              "connected_to": server[-1] if server else None})
    B.log(f"scale round {r + 1}: relay -> {label} {rate:.0f} msg/s; {_cores_text(m)}; "
          f"{_steps_text(m['batch'])}")
    return m


def phase_cluster(B):
    """scale-cluster (see the module docstring)."""
    if not B.have_idem():
        return
    A, n = B.A, B.A.scale_events
    res = B.RES.setdefault("scale", {})
    res["cluster"] = {"events": n, "nodes": A.scale_nodes, "drains": []}
    for qn in ("bench.consumer", "bench.raw", "bench.recipe"):
        B.q_delete(qn)  # the relay's messages go to bench.sink only, as on the cluster
    base = B.SERVERS.svc_dir if B.SERVERS.svc_dir and os.access(B.SERVERS.svc_dir, os.W_OK) \
        else None
    cl = Cluster(base, A.scale_nodes)
    t = time.monotonic()
    try:
        try:
            cl.start()
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            raise B.Failure(f"starting a {A.scale_nodes}-node RabbitMQ cluster: {e}") from None
        B.log(f"{A.scale_nodes}-node RabbitMQ cluster up in {time.monotonic() - t:.0f} s "
              f"({cl.urls})")
        cbroker = H.Broker(cl.url(1))
        B.bind_sink()
        declare(B, SINK, cl.urls, ("--bind", "payment.failed"), check_url=cl.url(1))
        res["cluster"]["sink_leader"] = cl.leader(SINK)
        res["cluster"]["sink_members"] = cl.members(SINK)
        res["cluster"]["urls"] = cl.urls
        B.log(f"{SINK} on the cluster: leader node {res['cluster']['sink_leader']}, "
              f"{res['cluster']['sink_members']}")
        targets = {"single": (B.SERVERS.amqp_url, B.BROKER, rmq_pids(B.SERVERS.svc_dir)),
                   "cluster": (cl.urls, cbroker, rmq_pids(cl.dir, A.scale_nodes))}
        for r in range(A.scale_rounds):
            order = ["single", "cluster"] if r % 2 == 0 else ["cluster", "single"]
            for label in order:
                amqp, broker, roots = targets[label]
                idle = targets["cluster" if label == "single" else "single"][2]
                res["cluster"]["drains"].append(
                    _relay_drain(B, label, amqp, broker, roots, idle, n, r))
    finally:
        cl.stop()
        B.q_delete(SINK)
        B.truncate("idem.event_outbox")
    med = {k: _median_meter([d for d in res["cluster"]["drains"] if d["broker"] == k])
           for k in ("single", "cluster")}
    res["cluster"]["median"] = med
    single, clus = B.med("scale.relay.single"), B.med("scale.relay.cluster")
    B.note(f"scale-cluster: {n:,} pending payment.failed rows drained by one relay (batch "
           f"{A.batch}) into {SINK}, a quorum queue on the single node or on the "
           f"{A.scale_nodes}-node cluster (members: {res['cluster'].get('sink_members')}; "
           f"leader node {res['cluster'].get('sink_leader')}); medians of {A.scale_rounds} "
           "round(s), brokers alternating")
    for k, v in (("single", single), ("cluster", clus)):
        if v is None or med[k] is None:
            continue
        ratio = f" ({v / single:.2f}x the single node)" if k == "cluster" and single else ""
        what = "the single node" if k == "single" else f"the {A.scale_nodes}-node cluster"
        B.note(f"scale relay -> {what}: {v:,.0f} msg/s{ratio}; during the drain (medians): "
               f"{_cores_text(med[k])}; {_steps_text(med[k].get('batch'))}")
