"""The chaos run's daemons: one slot per relay and consumer process (its proxy port, its
metrics, its instances across restarts), the sampler of the outbox, ledger and queues, and the
run's process actions (start, supervise and restart, pick, kill, stop). Daemons are started
on the main thread, so that they die with the run whatever kills it (PR_SET_PDEATHSIG follows
the thread that forked)."""

import contextlib
import os
import signal
import threading
import time
from collections import Counter

import psycopg2

import idem_harness as H
import proxy

CONSUMER = "billing"
QUEUE = "billing.events.q"
STOP_GRACE_S = 15  # a daemon must exit within this long after SIGTERM
CONSUMER_METRICS = {"applied": "idem_consumer_applied_total",
                    "duplicates": "idem_consumer_duplicates_total",
                    "dead_lettered": "idem_consumer_dead_lettered_total",
                    "paused": "idem_consumer_paused_total",
                    "handler_errors": "idem_consumer_handler_errors_total",
                    "reconnects": "idem_reconnects_total"}
RELAY_METRICS = {"published": "idem_relay_published_total",
                 "publish_failures": "idem_relay_publish_failures_total",
                 "parked": "idem_relay_parked_total",
                 "reconnects": "idem_reconnects_total"}


class Proc:
    """One daemon slot (relay1, consumer2, ...): its process across restarts, its own proxy
    port to RabbitMQ, its metrics port, and its counters summed over instances."""

    def __init__(self, name, role, argv, run):
        self.name = name
        self.role = role
        self.metrics_port = H.free_port()
        self.listener = proxy.Listener(name, ("127.0.0.1", run.amqp_port))
        amqp = f"amqp://guest:guest@127.0.0.1:{self.listener.port}"
        self.daemon = H.Daemon(name, argv + ["--metrics-port", str(self.metrics_port)],
                               run.logs, run.servers.pg_url, amqp,
                               logpath=os.path.join(run.logs, f"{name}.log"), new_session=True)
        self.instances = 0
        self.spawned = 0.0
        self.expect = None  # 'kill' (we SIGKILLed it) or 'term' (we sent SIGTERM)
        self.stopped = False  # SIGSTOPped (stop-relay), until SIGCONT
        self.next_fault = None  # IDEM_FAULT of the restart after an expected exit
        self.term_deadline = 0.0
        self.last = {}  # the current instance's last scrape
        self.base = Counter()  # summed over the earlier instances
        self.recent = 0.0  # applied/published between the last two scrapes

    def pid(self):
        return self.daemon.proc.pid if self.daemon.proc else None

    def running(self):
        return self.daemon.running()

    def metric(self, key):
        return self.base[key] + self.last.get(key, 0.0)


class Monitor(threading.Thread):
    """Samples the outbox, the ledger and the queues about once a second on its own
    connections, so that a stalled server never stalls the run's main loop."""

    def __init__(self, run):
        super().__init__(name="monitor", daemon=True)
        self.run_ = run
        self.stop = threading.Event()
        self.snap = None  # (monotonic time, db dict or None, {queue: ready or None} or None)
        self.conn = None

    def db_sample(self):
        if self.conn is None or self.conn.closed:
            self.conn = psycopg2.connect(self.run_.servers.pg_url, connect_timeout=2,
                                         application_name="chaos-monitor",
                                         options="-c lock_timeout=300 -c statement_timeout=3000")
            self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute("SELECT count(*), count(*) FILTER (WHERE status = 'pending'),"
                        " count(*) FILTER (WHERE status = 'sent'),"
                        " count(*) FILTER (WHERE status = 'failed') FROM idem.event_outbox")
            total, pending, sent, failed = cur.fetchone()
            cur.execute("SELECT count(*) FROM idem.consumed_events WHERE consumer = %s", (CONSUMER,))
            ledger = cur.fetchone()[0]
        return {"total": total, "pending": pending, "sent": sent, "failed": failed,
                "ledger": ledger}

    def run(self):
        broker = H.Broker(self.run_.servers.amqp_url)
        queues = self.run_.work_queues + [self.run_.dlq]
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                db = self.db_sample()
            except psycopg2.Error:
                db = None
                with contextlib.suppress(Exception):
                    self.conn.close()
                self.conn = None
            try:
                infos = broker.queue_infos(queues)
                q = {name: (None if i is None else i[0]) for name, i in infos.items()}
            except Exception:
                q = None
            self.snap = (t, db, q)
            self.stop.wait(max(0.1, 1.0 - (time.monotonic() - t)))
        with contextlib.suppress(Exception):
            self.conn.close()


class Daemons:
    """The process side of Run (a mixin): needs a, servers, logs, procs, listeners, problems,
    seams_fired, seams_armed, work_queues, now(), event()."""

    def daemon_flags(self):
        hb = [] if self.a.heartbeat == "off" else ["--heartbeat", self.a.heartbeat]
        parts = [] if self.a.partitions == 1 else ["--partitions", str(self.a.partitions)]
        return hb, parts

    def make_procs(self):
        hb, parts = self.daemon_flags()
        for i in range(1, self.a.consumers + 1):
            p = Proc(f"consumer{i}", "consumer", [H.IDEM, "consume", "--consumer", CONSUMER,
                                                  "--queue", QUEUE, *parts, *hb], self)
            self.procs[p.name] = p
        for i in range(1, self.a.relays + 1):
            p = Proc(f"relay{i}", "relay", [H.IDEM, "relay", *hb], self)
            self.procs[p.name] = p
        self.listeners = {p.name: p.listener for p in self.procs.values()}

    def spawn(self, p, fault=None):
        p.daemon.set_fault(fault)
        p.instances += 1
        # libpq's application_name: the audit can tell which instance made each effect
        p.daemon.env["PGAPPNAME"] = f"idem-{p.name}-{p.instances}"
        with open(p.daemon.logpath, "a") as f:
            f.write(f"---- {p.name} instance {p.instances} at {self.now():.1f}s"
                    f"{' (IDEM_FAULT=' + fault + ')' if fault else ''}\n")
        p.daemon.spawn()
        p.spawned = time.monotonic()
        p.last = {}
        p.expect = None
        if fault:
            self.seams_armed[fault.split(":")[0]] += 1

    def start_daemons(self):
        """Starts the consumers together (as a deployment would), waits until every work queue
        has a consumer, then starts the relays. A consumer that exits meanwhile is recorded and
        restarted like at any other time; one that fails 3 times ends the run."""
        for p in self.procs.values():
            if p.role == "consumer":
                self.spawn(p)
        # The consumers declare the exchange, their queues and bindings: wait for them before
        # anything is published, or the first events would be unroutable.
        broker = H.Broker(self.servers.amqp_url)

        def ready():
            self.supervise()
            for p in self.procs.values():
                if p.role == "consumer" and p.instances > 3:
                    raise RuntimeError(f"{p.name} keeps exiting at start; see {p.daemon.logpath}:"
                                       f"\n{p.daemon.log()[-1500:]}")
            infos = broker.queue_infos(self.work_queues + [self.dlq])
            return all(i is not None for i in infos.values()) and all(
                infos[q][1] >= 1 for q in self.work_queues)

        H.wait_until(ready, 30, 0.2, f"consumers consuming from {', '.join(self.work_queues)}")
        for p in self.procs.values():
            if p.role == "relay":
                self.spawn(p)

    def pick_proc(self, role, rng, min_age=0.0):
        """A running daemon of role to hit, up for min_age seconds at least; consumers that
        applied events lately (the active ones) three times as often as standbys."""
        now = time.monotonic()
        cands = sorted((p for p in self.procs.values()
                        if p.role == role and p.running() and p.expect is None
                        and not p.stopped and now - p.spawned >= min_age),
                       key=lambda p: p.name)
        if not cands:
            return None
        weights = [3 if p.recent > 0 else 1 for p in cands]
        return rng.choices(cands, weights)[0]

    def kill_proc(self, p):
        p.expect = "kill"
        with contextlib.suppress(ProcessLookupError):
            p.daemon.proc.kill()

    def restart_proc(self, p, fault):
        """SIGTERM now; the supervisor restarts it with IDEM_FAULT=fault once it exited."""
        p.expect = "term"
        p.next_fault = fault
        p.term_deadline = time.monotonic() + STOP_GRACE_S
        with contextlib.suppress(ProcessLookupError):
            p.daemon.proc.terminate()

    def retire(self, p):
        for k, v in p.last.items():
            p.base[k] += v
        p.last = {}

    def supervise(self):
        """Restarts every daemon that exited; records the exits nobody planned."""
        for p in self.procs.values():
            proc = p.daemon.proc
            if proc is None:
                continue
            rc = proc.poll()
            if rc is None:
                if p.expect == "term" and time.monotonic() > p.term_deadline:
                    self.problems.append(f"{p.name} instance {p.instances} still running "
                                         f"{STOP_GRACE_S} s after SIGTERM (killed)")
                    p.expect = "kill"
                    proc.kill()
                continue
            self.retire(p)
            p.daemon.close()
            fault = p.daemon.fault
            if p.expect == "kill":
                pass
            elif rc == -signal.SIGKILL and fault:  # also while finishing its work on SIGTERM
                point = fault.split(":")[0]
                self.seams_fired[point] += 1
                self.event(f"{p.name} crashed at {fault} (IDEM_FAULT); restarted")
            elif p.expect == "term":
                if rc != 0:
                    self.problems.append(f"{p.name} instance {p.instances} exited {rc} on SIGTERM")
                    self.event(f"{p.name} exited {rc} on SIGTERM (expected 0)")
            else:
                self.problems.append(f"{p.name} instance {p.instances} exited {rc} unplanned "
                                     f"(see {p.daemon.logpath})")
                self.event(f"{p.name} exited {rc} unplanned; restarted")
            nxt = p.next_fault if p.expect == "term" else None
            p.next_fault = None
            self.spawn(p, nxt)

    def scrape(self, p):
        if not p.running() or p.stopped:
            return
        m = H.read_metrics(p.metrics_port, timeout=0.5)
        if m is None:
            return
        names = CONSUMER_METRICS if p.role == "consumer" else RELAY_METRICS
        vals = {k: H.metric_sum(m, name) for k, name in names.items()}
        key = "applied" if p.role == "consumer" else "published"
        p.recent = vals[key] - p.last.get(key, 0.0)
        p.last = vals

    def total(self, role, key):
        return sum(p.metric(key) for p in self.procs.values() if p.role == role)

    def stop_daemons(self):
        """SIGTERM to every daemon; each must exit 0 within STOP_GRACE_S."""
        for p in self.procs.values():
            self.scrape(p)
        live = [p for p in self.procs.values() if p.running()]
        for p in live:
            p.daemon.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            try:
                rc = p.daemon.proc.wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                p.daemon.proc.kill()
                p.daemon.proc.wait(5)
                self.problems.append(f"{p.name} did not exit within {STOP_GRACE_S} s of the "
                                     f"final SIGTERM (killed)")
                continue
            if rc == -signal.SIGKILL and p.daemon.fault:
                self.seams_fired[p.daemon.fault.split(":")[0]] += 1
                self.event(f"{p.name} crashed at {p.daemon.fault} (IDEM_FAULT) while stopping")
            elif rc != 0:
                self.problems.append(f"{p.name} exited {rc} on the final SIGTERM "
                                     f"(see {p.daemon.logpath})")
        for p in self.procs.values():
            p.daemon.close()
