#!/usr/bin/python3
"""scripts/chaos.py - idem's chaos audit (`make chaos`): the billing scenario at scale under
injected faults, then an audit of the end state against a plan computed independently.

    make chaos [SEED=n] [TOPOLOGY=plain|partitioned] [CHAOS_ARGS='--quick ...']
    make chaos-all [SEEDS="1 2 3 4 5"]       each seed in both topologies, then a table
    scripts/chaos.py [--quick] [--seed N] [--topology T] [--events N] [--subs N] ...

Starts private PostgreSQL and RabbitMQ (scripts/services.sh) in a temporary directory, always
stopped at exit; needs root, build/idem and Debian's python3 (pika, psycopg2).

The run: a scenario of subscriptions and invoices (payment failures, payments, replays of the
same operation) is committed by a few emitter connections, each subscription by one of them in
a known order (scripts/chaos/emitter.py), while relays and a consumer group run with
--heartbeat: in the plain topology two processes on the one queue (one active, one standing
by), in the partitioned one three processes on --partitions 2. Every 1-3 s a fault is injected
(scripts/chaos/faults.py), from kills, stops and crashes at idem's fault seams to server
restarts (RabbitMQ's with a backlog in the queues), frozen, half-open and reset AMQP links
(scripts/chaos/proxy.py sits between every daemon and RabbitMQ), cancelled and terminated
backends, a lock on the outbox and SQLSTATEs 25006 and 53100 raised by triggers
(scripts/chaos/schema.sql). Then the outbox and queues must drain, every daemon must stop
cleanly on SIGTERM, and the audit (scripts/chaos/audit.py) must pass on every line. Exit 0 only
then. --seeds runs several (scripts/chaos/matrix.py), each in its own process.

The seed fixes the scenario and the fault plan (kinds, times, targets' random choices); the
interleaving of threads and processes differs from run to run.
"""

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "chaos"))
sys.path.insert(0, os.path.join(ROOT, "tests", "harness"))

import psycopg2  # noqa: E402

import emitter  # noqa: E402
import faults  # noqa: E402
import idem_harness as H  # noqa: E402
import matrix  # noqa: E402
import scenario  # noqa: E402
from daemons import CONSUMER, QUEUE, Daemons, Monitor  # noqa: E402
from report import Reporting  # noqa: E402

# topology -> (--partitions, consumer processes)
TOPOLOGIES = {"plain": (1, 2), "partitioned": (2, 3)}
DEMO_SCHEMA = os.path.join(ROOT, "scripts", "demo", "schema.sql")
CHAOS_SCHEMA = os.path.join(HERE, "chaos", "schema.sql")
FAULT_MAX_DELAY_S = 60  # longest a fault waits for its preconditions (e.g. an open AMQP link)
FAULT_MIN_GAP_S = 1.0  # between two faults, also when some were held back

class Interrupted(Exception):
    pass


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="chaos", description="idem's chaos audit: the billing scenario under faults, "
        "then an exactly-once audit. Exit 0 only if every audit line passes.")
    ap.add_argument("--seed", type=int, help="random seed (default: a new one, printed)")
    ap.add_argument("--quick", action="store_true",
                    help="development size: --events 3000 --subs 100 --duration 20")
    ap.add_argument("--events", type=int, help="outbox events to produce, at least (52000)")
    ap.add_argument("--subs", type=int, help="subscriptions (600)")
    ap.add_argument("--duration", type=float,
                    help="seconds over which the workload is emitted and faults injected (90)")
    ap.add_argument("--replay-pct", type=float, default=10.0,
                    help="share of operations run twice with the same dedup key (10)")
    ap.add_argument("--emitters", type=int, default=4, help="emitter connections (4)")
    ap.add_argument("--relays", type=int, default=2, help="relay processes (2)")
    ap.add_argument("--topology", choices=sorted(TOPOLOGIES), default="partitioned",
                    help="plain: one queue, consumed by 2 processes (one active, one standing "
                    "by); partitioned: --partitions 2, 3 processes on both partitions "
                    "(default partitioned)")
    ap.add_argument("--consumers", type=int,
                    help="consumer processes in the one consumer group (the topology's)")
    ap.add_argument("--partitions", type=int,
                    help="--partitions of the consumer group; 1 runs without the flag "
                    "(the topology's)")
    ap.add_argument("--heartbeat", default="2s",
                    help="--heartbeat of every daemon; 'off' runs without the flag (2s)")
    ap.add_argument("--faults", default="all",
                    help="fault kinds: all, none, or a comma list of kinds and groups "
                    "(process, server, link, db): " + ", ".join(faults.KINDS))
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="seconds after the last fault (and the last emit) to drain (60)")
    ap.add_argument("--workdir", help="directory for servers and logs (default: a new one "
                    "under /tmp; kept after a failed run or with --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--summary", help="write the run's figures and audit lines to this JSON file")
    ap.add_argument("--seeds", help="run each of these seeds (space or comma separated) in each "
                    "--topologies, one run at a time, then print one table (make chaos-all)")
    ap.add_argument("--topologies", default="plain,partitioned",
                    help="with --seeds: the topologies to run (plain,partitioned)")
    a = ap.parse_args(argv)
    a.argv = list(argv)
    if a.seeds is not None:
        try:
            a.seeds = matrix.parse_seeds(a.seeds)
        except ValueError:
            ap.error("--seeds: integers, space or comma separated")
        a.topologies = [t.strip() for t in a.topologies.split(",") if t.strip()]
        if not a.topologies or any(t not in TOPOLOGIES for t in a.topologies):
            ap.error("--topologies: a comma list of " + ", ".join(sorted(TOPOLOGIES)))
    quick = a.quick
    a.events = a.events or (3000 if quick else 52000)
    a.subs = a.subs or (100 if quick else 600)
    a.duration = a.duration or (20.0 if quick else 90.0)
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 10**6)
    try:
        a.fault_kinds = faults.parse_kinds(a.faults)
    except ValueError as e:
        ap.error(str(e))
    parts, procs = TOPOLOGIES[a.topology]
    a.partitions = parts if a.partitions is None else a.partitions
    a.consumers = procs if a.consumers is None else a.consumers
    hb = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s)?", a.heartbeat)
    if a.heartbeat != "off" and not hb:
        ap.error("--heartbeat: a duration (e.g. 2s) or off")
    a.heartbeat_s = None if not hb else float(hb.group(1)) / (1000 if hb.group(2) == "ms" else 1)
    if a.subs < 1 or a.events < a.subs or a.emitters < 1 or a.relays < 1 or a.consumers < 1:
        ap.error("need --subs >= 1, --events >= --subs, and at least one emitter, relay, consumer")
    if a.partitions < 1:
        ap.error("--partitions must be >= 1")
    return a


def replay_args(a):
    """The command-line flags that reproduce this run's scenario and fault plan."""
    out, words = [], iter(a.argv)
    for w in words:
        if w in ("--seed", "--workdir", "--summary"):
            next(words, None)
        elif not (w.startswith(("--seed=", "--workdir=", "--summary=")) or w == "--keep"):
            out.append(w)
    if "--topology" not in out and not any(w.startswith("--topology=") for w in out):
        out = ["--topology", a.topology] + out
    return ["--seed", str(a.seed)] + out


class Run(Daemons, Reporting):
    def __init__(self, args):
        self.a = args
        self.t0 = None  # workload start (monotonic)
        self.work = args.workdir or tempfile.mkdtemp(prefix="idem-chaos.")
        os.makedirs(self.work, exist_ok=True)
        os.chmod(self.work, 0o755)  # user postgres must reach the data directory below it
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.svc_dir = os.path.join(self.work, "svc")
        self.logfile = open(os.path.join(self.logs, "chaos.log"), "a")
        self.faultlog = open(os.path.join(self.logs, "faults.log"), "a")
        self.servers = None
        self.procs = {}
        self.listeners = {}
        self.problems = []  # unplanned exits and unclean stops
        self.seams_fired = Counter()
        self.seams_armed = Counter()
        self.emitters = []
        self.injector = None
        self.monitor = None
        self.stop_flag = threading.Event()
        self.emit_stop = threading.Event()
        self.print_lock = threading.Lock()
        P = args.partitions
        self.work_queues = [f"{QUEUE}.p{i}" for i in range(P)] if P > 1 else [QUEUE]
        self.dlq = QUEUE + ".dlq"
        self.heartbeat_s = args.heartbeat_s
        # rmq-restart waits for this many messages ready in the work queues
        self.backlog_target = min(2000, max(100, args.events // 25))

    # ------------------------------------------------------------------ output

    def now(self):
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def say(self, text=""):
        with self.print_lock:
            print(text, flush=True)
            self.logfile.write(text + "\n")
            self.logfile.flush()

    def event(self, text):
        """A timestamped line, on the terminal and in faults.log."""
        line = f"  {self.now():7.1f}s  {text}"
        self.say(line)
        with self.print_lock:
            self.faultlog.write(line + "\n")
            self.faultlog.flush()

    # ------------------------------------------------------------------ servers and schema

    def start_servers(self):
        t = time.monotonic()
        self.servers = H.start_servers(self.svc_dir)
        self.amqp_port = int(self.servers.amqp_url.rsplit(":", 1)[1].split("/")[0])
        self.pg = H.Db(self.servers.pg_url)
        # synchronous_commit on: an immediate stop (pg-restart) loses async commits that were
        # already acknowledged, which the audit would count as lost events. fsync stays off
        # (services.sh's default, for speed): an immediate stop of the server does not lose
        # the operating system's page cache, only a machine crash would.
        self.pg.execute("ALTER SYSTEM SET synchronous_commit = on")
        self.pg.execute("SELECT pg_reload_conf()")
        H.wait_until(lambda: self.pg.scalar("SHOW synchronous_commit") == "on", 10, 0.1,
                     "synchronous_commit = on")
        plugins = os.path.join(self.svc_dir, "rmq", "enabled_plugins")
        if self.a.partitions > 1 and "rabbitmq_consistent_hash_exchange" not in open(plugins).read():
            # The partitioned topology needs the plugin; enable it and restart the broker.
            self.servers.rmq_stop()
            with open(plugins, "w") as f:
                f.write("[rabbitmq_consistent_hash_exchange].\n")
            self.servers.rmq_start()
        self.say(f"  PostgreSQL 127.0.0.1:{self.servers.pg_url.rsplit(':', 1)[1].split('/')[0]} "
                 f"(synchronous_commit on, fsync off), RabbitMQ 127.0.0.1:{self.amqp_port} "
                 f"(up in {time.monotonic() - t:.1f} s)")

    def prepare_db(self, plan):
        r = H.run_idem("migrate", "--billing", pg_url=self.servers.pg_url,
                       amqp_url=self.servers.amqp_url)
        with open(os.path.join(self.logs, "migrate.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"idem migrate failed ({r.returncode}): {r.stderr.strip()}")
        with self.pg.connect(autocommit=False) as conn:
            with conn.cursor() as cur:
                for path in (DEMO_SCHEMA, CHAOS_SCHEMA):
                    with open(path) as f:
                        cur.execute(f.read())
            conn.commit()
            emitter.load_business_data(conn, plan)

    @contextlib.contextmanager
    def admin_conn(self, autocommit=True):
        conn = psycopg2.connect(self.servers.pg_url, connect_timeout=3,
                                application_name="chaos-faults")
        conn.autocommit = autocommit
        try:
            yield conn
        finally:
            conn.close()

    def backend_owners(self):
        """{client port: daemon name} of the daemons' TCP connections (from /proc), to name the
        daemon behind a PostgreSQL backend (pg_stat_activity.client_port)."""
        inode_owner = {}
        for p in self.procs.values():
            pid = p.pid()
            if pid is None:
                continue
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if link.startswith("socket:["):
                            inode_owner[link[8:-1]] = p.name
        owners = {}
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    name = inode_owner.get(cols[9])
                    if name:
                        owners[int(cols[1].rsplit(":", 1)[1], 16)] = name
        return owners

    def set_fault_sqlstate(self, code):
        """Switches the triggers' SQLSTATE on (code) or off (None); returns the number of
        writes refused so far."""
        with self.admin_conn() as conn, conn.cursor() as cur:
            cur.execute("UPDATE chaos.fault SET sqlstate = %s", (code,))
            cur.execute("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM chaos.refused")
            return cur.fetchone()[0]

    def queue_depths(self):
        """{work queue: messages ready}, asked of the broker directly (not through a proxy)."""
        infos = H.Broker(self.servers.amqp_url).queue_infos(self.work_queues)
        return {q: (i[0] if i else 0) for q, i in infos.items()}

    # ------------------------------------------------------------------ the run

    def progress(self, plan_tx):
        snap = self.monitor.snap if self.monitor else None
        emitted = sum(e.n_committed for e in self.emitters)
        line = f"  {self.now():7.1f}s  emitted {emitted}/{plan_tx}"
        if snap and snap[1]:
            d = snap[1]
            line += (f" | outbox {d['total']} (pending {d['pending']}) | sent {d['sent']}"
                     f" | applied {d['ledger']}")
        else:
            line += " | database: no answer"
        if snap and snap[2]:
            ready = sum(v for q, v in snap[2].items() if q != self.dlq and v is not None)
            line += f" | queued {ready} | dlq {snap[2].get(self.dlq)}"
        else:
            line += " | broker: no answer"
        self.say(line)

    def drained(self, expected_total):
        snap = self.monitor.snap
        if snap is None or snap[1] is None or snap[2] is None:
            return False, snap
        d, q = snap[1], snap[2]
        ok = (d["pending"] == 0 and d["total"] == expected_total and d["ledger"] == expected_total
              and all(q.get(name) == 0 for name in self.work_queues))
        return ok, snap

    def execute(self):
        a = self.a
        self.say(f"idem chaos audit, seed {a.seed}, topology {a.topology} (--partitions "
                 f"{a.partitions}, {a.consumers} consumer processes)")
        self.say(f"  replay with: scripts/chaos.py {' '.join(replay_args(a))}")
        self.say(f"  work directory {self.work}")
        plan = scenario.Scenario(a.seed, a.subs, a.events, a.replay_pct)
        pc = plan.counts()
        self.say(f"  scenario: {a.subs} subscriptions, {pc['invoices']} invoices, "
                 f"{pc['transactions']} business transactions ({pc['operations']} operations + "
                 f"{pc['replays']} replays) -> {pc['events']} events")
        self.start_servers()
        self.prepare_db(plan)
        self.make_procs()
        hb, parts = self.daemon_flags()
        consume = " ".join(["idem consume --consumer", CONSUMER, "--queue", QUEUE, *parts, *hb])
        self.say(f"  daemons: {a.consumers} x {consume}; {a.relays} x "
                 + " ".join(["idem relay", *hb]))
        self.say("           each through its own proxy port to RabbitMQ; metrics scraped")
        self.start_daemons()

        window = a.duration
        plan_faults = faults.schedule(a.seed, a.fault_kinds, window)
        inj = self.injector = faults.Injector(self, a.seed)
        kinds = Counter(f.kind for f in plan_faults)
        self.say(f"  fault plan: {len(plan_faults)} faults over "
                 f"{plan_faults[-1].at if plan_faults else 0:.0f} s: "
                 + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        self.say("")

        self.monitor = Monitor(self)
        self.monitor.start()
        subs_of = [plan.subs[i::a.emitters] for i in range(a.emitters)]
        emit_stop = self.emit_stop
        self.t0 = time.monotonic()
        self.emitters = [emitter.EmitterThread(i + 1, self.servers.pg_url, plan, subs_of[i],
                                               a.duration, a.seed, emit_stop)
                         for i in range(a.emitters)]
        for e in self.emitters:
            e.start()
        self.event(f"workload started: {a.emitters} emitter connections")

        next_fault = 0
        fault_not_before = 0.0
        emit_end = None
        last_fault_end = None
        drain_from = None
        drained_after = None
        drain_since = ""
        stable = 0
        expected = None
        next_progress = self.t0 + 5
        next_scrape = self.t0
        emit_deadline = self.t0 + 3 * a.duration + 120
        while True:
            if self.stop_flag.is_set():
                raise Interrupted()
            now = time.monotonic()
            self.supervise()
            if now >= next_scrape:
                for p in self.procs.values():
                    if p.running():
                        self.scrape(p)
                next_scrape = now + 1.0
            # Faults, in plan order; one that may not start yet holds the ones behind it, for
            # FAULT_MAX_DELAY_S at most (then it is tried anyway, and reported if it fails),
            # or for as long as a conflicting fault lasts (inj.blocked).
            # Faults held back start at least FAULT_MIN_GAP_S apart, not all at once.
            while (next_fault < len(plan_faults) and plan_faults[next_fault].at <= self.now()
                   and now >= fault_not_before):
                f = plan_faults[next_fault]
                if not inj.ready(f.kind) and (self.now() - f.at < FAULT_MAX_DELAY_S
                                              or inj.blocked(f.kind)):
                    break
                inj.inject(f)
                next_fault += 1
                fault_not_before = now + FAULT_MIN_GAP_S
                self.event(f"{f.kind:<19} {f.target} {f.detail}".rstrip())
            if emit_end is None and all(not e.is_alive() for e in self.emitters):
                emit_end = now
                n = sum(e.n_committed for e in self.emitters)
                self.event(f"workload done: {n} transactions committed")
            if emit_end is None and now > emit_deadline:
                emit_stop.set()
                self.event("workload stopped: not done in time")
            if now >= next_progress:
                self.progress(pc["transactions"])
                next_progress = now + 5
            faults_over = next_fault == len(plan_faults) and inj.idle()
            if drain_from is None and emit_end is not None and faults_over:
                ends = [f.ended for f in plan_faults if f.ended is not None]
                last_fault_end = max(ends) if ends else self.t0
                drain_from = max(last_fault_end, emit_end)
                drain_since = ("the last fault" if last_fault_end >= emit_end
                               else "the last emit (after the last fault)")
                committed = {}
                for e in self.emitters:
                    committed.update(e.committed)
                expected = scenario.Expected(committed)
                self.event(f"faults over and workload committed; draining "
                           f"({len(expected.events)} events expected)")
            if drain_from is not None:
                ok, snap = self.drained(len(expected.events))
                if ok and snap[0] > drain_from:
                    stable += 1
                else:
                    stable = 0
                if stable >= 2:
                    drained_after = snap[0] - drain_from
                    self.event(f"drained {drained_after:.1f} s after {drain_since}")
                    break
                if now - drain_from > a.drain_timeout:
                    self.progress(pc["transactions"])
                    self.event(f"NOT drained {a.drain_timeout:g} s after {drain_since}")
                    break
            time.sleep(0.1)

        self.say("")
        self.say("Stopping relays and consumers with SIGTERM ...")
        self.stop_daemons()
        self.monitor.stop.set()
        self.monitor.join(5)
        for ln in self.listeners.values():
            ln.close()
        return self.report(plan, pc, plan_faults, expected, drained_after, drain_since)

    def cleanup(self, keep):
        self.stop_flag.set()
        if self.injector is not None:
            self.injector.join()  # a fault thread must not start a server after this
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.daemon.kill()
        self.emit_stop.set()
        for e in self.emitters:
            e.join(5)
        if self.monitor:
            self.monitor.stop.set()
        for ln in self.listeners.values():
            with contextlib.suppress(Exception):
                ln.close()
        if self.servers is not None or os.path.exists(os.path.join(self.svc_dir, "state.sh")):
            self.say("stopping PostgreSQL and RabbitMQ ...")
            H.stop_servers(self.svc_dir, quiet=True)
        self.logfile.close()
        self.faultlog.close()
        if keep:
            print(f"logs kept in {self.logs} (remove {self.work} when done)")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def main(argv):
    a = parse_args(argv)
    if a.seeds is not None:
        return matrix.run_all(os.path.abspath(__file__), a.seeds, a.topologies, argv)
    if os.geteuid() != 0:
        sys.exit("chaos: run as root (the private PostgreSQL runs as user postgres)")
    if not os.access(H.IDEM, os.X_OK):
        sys.exit(f"chaos: {H.IDEM} not found: run make first (or make chaos)")
    run = Run(a)
    run.started = time.monotonic()

    def on_signal(sig, frame):
        run.stop_flag.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    ok = False
    try:
        ok = run.execute()
    except Interrupted:
        run.say("interrupted; stopping everything")
    except Exception as e:
        run.say(f"chaos: {type(e).__name__}: {e}")
        import traceback
        run.logfile.write(traceback.format_exc())
    finally:
        run.cleanup(keep=a.keep or not ok)
        print(f"seed {a.seed}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
