#!/usr/bin/python3
"""scripts/demo.py - idem's end-to-end demo (`make demo`): a small billing app emits a few
thousand events, some of them twice, while relays and consumers are killed and crash at their
worst moments; then every effect is audited. Exit 0 only if every audit line passes.

    make demo
    scripts/demo.py [--keep] [--out DIR]

Starts private PostgreSQL and RabbitMQ servers in a temporary directory (scripts/services.sh,
through tests/harness/idem_harness.py), always stopped at exit. Needs root (the private
PostgreSQL runs as user postgres), build/idem, psql, Debian's python3 (pika, psycopg2) and
gnuplot (`make demo` installs and builds all of it). Takes about a minute.

The run: scripts/demo/schema.sql is the billing app, scripts/demo/plan.sql scripts its
workload, scripts/demo/render.sql turns it into three paced psql sessions of business
transactions (an invoice update plus idem_emit, committed together). Two relays and two
consumers run meanwhile, supervised here; a relay and a consumer are SIGKILLed, then restarted
with IDEM_FAULT armed at a seam. scripts/demo/audit.sql compares idem's effects with the plan.
The numbers sampled for the live line are drawn as DIR/timeline.svg (default build/demo) with a
marker at every fault (scripts/demo/timeline.py).

Environment: IDEM_DEMO_KEEP=1 (or --keep) keeps the temporary directory (logs, data) after the
run; it is always kept when the demo fails. IDEM_BIN runs another idem binary.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEMO = os.path.join(HERE, "demo")
sys.path.insert(0, DEMO)
sys.path.insert(0, os.path.join(ROOT, "tests", "harness"))

import psycopg2  # noqa: E402

import idem_harness as H  # noqa: E402
from timeline import Timeline  # noqa: E402

CONSUMER = "billing"
QUEUE = "billing.events.q"
DLQ = QUEUE + ".dlq"
# The scenario. Phase 1 lasts PHASE1_TICKS x 100 ms.
DUNNING_SUBS = 70
PAYING_SUBS = 110
RECOVERING_SUBS = 20
PHASE1_TICKS = 200
REPLAY_PCT = 10
DRAIN_TIMEOUT_S = 40
TICK_S = 0.5

# Faults, in seconds after the workload starts.
T_KILL_RELAY = 5.0
T_RESTART_RELAY = 6.0
RELAY_FAULT = "relay.after_publish:3"
T_KILL_CONSUMER = 9.0
T_RESTART_CONSUMER = 10.0
CONSUMER_FAULT = "consumer.after_commit:5"
T_PHASE2_EARLIEST = 8.0
STOP_GRACE_S = 10

CONSUMER_METRICS = {"applied": "idem_consumer_applied_total",
                    "duplicates": "idem_consumer_duplicates_total",
                    "dead_lettered": "idem_consumer_dead_lettered_total"}

# Payment failures of the recovering subscriptions not consumed yet (phase 2 waits for 0).
RECOV_LEFT_SQL = f"""(SELECT count(*) FROM (SELECT DISTINCT o.invoice_id, o.attempt_no
              FROM demo.ops o JOIN invoices i USING (invoice_id) JOIN demo.subs s
              USING (subscription_id) WHERE s.story = 'recovering' AND o.kind = 'fail') f
             WHERE NOT EXISTS (SELECT 1 FROM idem.consumed_events c WHERE c.consumer = '{CONSUMER}'
               AND c.event_id = md5(f.invoice_id || ':failed:' || f.attempt_no)::uuid))"""
STATS_SQL = """
    SELECT (SELECT coalesce(sum(ops), 0) FROM demo.progress),
           count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'sent'),
           count(*) FILTER (WHERE status = 'failed'), count(*),
           count(*) FILTER (WHERE event_type IN ('invoice.paid', 'payment.failed')),
           (SELECT count(*) FROM idem.consumed_events WHERE consumer = %s),
           {recov}
    FROM idem.event_outbox"""
STAT_KEYS = ("emitted", "pending", "sent", "failed", "total", "business", "consumed",
             "recov_left")


class DemoFailed(Exception):
    """A step that cannot go on: the message is shown, the logs are kept, exit 1."""


class Interrupted(Exception):
    def __init__(self, status):
        super().__init__(status)
        self.status = status


# ------------------------------------------------------------------------------------ output


class Out:
    """The terminal: colours and a live line that later lines overwrite when it is a TTY;
    without one, the live line is printed every 2 s."""

    def __init__(self):
        self.tty = sys.stdout.isatty()
        esc = (lambda c: f"\033[{c}m") if self.tty else (lambda c: "")
        self.B, self.DIM, self.GRN, self.RED, self.YEL, self.RST = (
            esc(1), esc(2), esc(32), esc(31), esc(33), esc(0))
        self.CLR = "\r\033[K" if self.tty else ""
        self.live_shown = False
        self.last_live = -100.0
        self.cols = shutil.get_terminal_size((100, 24)).columns

    def say(self, text=""):
        print(f"{self.CLR}{text}", flush=True)
        self.live_shown = False

    def step(self, text):
        self.say(f"{self.B}{text}{self.RST}")

    def live(self, now, line):
        if self.tty:
            if len(line) >= self.cols:  # narrow terminal: the compact form
                line = re.sub(r" +", " ", line.replace("|", "")).strip()
            sys.stdout.write(f"\r\033[K{line[:self.cols - 1]}")
            sys.stdout.flush()
            self.live_shown = True
        elif now - self.last_live >= 2.0:
            print(line, flush=True)
            self.last_live = now

    def end_live(self):
        if self.live_shown:
            print(flush=True)
            self.live_shown = False


def fmt_t(t):
    return f"{t:5.1f}s"


# ------------------------------------------------------------------------------------ daemons


class Slot:
    """One relay or consumer (relay1, consumer2, ...) across restarts: its process, its log,
    its metrics port and counters summed over its instances (consumers)."""

    def __init__(self, name, run):
        self.name = name
        self.role = "relay" if name.startswith("relay") else "consumer"
        argv = [H.IDEM, "relay"]
        self.port = None
        self.counters = None
        if self.role == "consumer":
            self.port = H.free_port()
            self.counters = H.Counters(CONSUMER_METRICS)
            argv = [H.IDEM, "consume", "--consumer", CONSUMER, "--queue", QUEUE,
                    "--metrics-port", str(self.port)]
        self.daemon = H.Daemon(name, argv, run.logs, run.servers.pg_url, run.servers.amqp_url,
                               logpath=os.path.join(run.logs, f"{name}.log"), new_session=True)
        self.instances = 0
        self.down = False  # killed on purpose, not restarted yet

    @property
    def fault(self):
        return self.daemon.fault

    def start(self, fault=None):
        self.down = False
        self.instances += 1
        self.daemon.set_fault(fault)
        self.daemon.spawn(banner=f"---- {self.name} instance {self.instances}"
                          + (f" (IDEM_FAULT={fault})" if fault else ""))

    def scrape(self):
        if self.counters is not None and self.daemon.running():
            self.counters.scrape(self.port, timeout=1)

    def retire(self):
        if self.counters is not None:
            self.counters.retire()
        self.daemon.close()


# ------------------------------------------------------------------------------------ the run


class Run:
    def __init__(self, args):
        self.a = args
        self.o = Out()
        self.started = time.monotonic()
        self.t0 = None
        self.work = tempfile.mkdtemp(prefix="idem-demo.")
        os.chmod(self.work, 0o755)  # user postgres must reach the data directory below it
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs)
        self.svc_dir = os.path.join(self.work, "svc")
        self.servers = None
        self.db = None
        self.broker = None
        self.slots = {}
        self.sessions = {}  # session number -> Popen
        self.unexpected = []
        self.failed_run = False
        self.timeline = Timeline()
        self.stats = None
        self.st = dict.fromkeys(STAT_KEYS, 0)
        self.st["recov_left"] = 1
        self.recov_sql = RECOV_LEFT_SQL

    def now(self):
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def event(self, text, *more, kind=None, mark=None):
        """A timestamped line, more lines indented below it; kind/mark put a marker on the
        timeline."""
        t = self.now()
        self.o.say(f"  {fmt_t(t)}  {text}")
        for line in more:
            self.o.say(f"          {line}")
        if kind:
            self.timeline.mark(t, kind, mark)

    def die(self, text):
        raise DemoFailed(text)

    # ------------------------------------------------------------------ helpers

    def psql(self, *args, out=None, log="setup.log"):
        """psql against the demo database (ON_ERROR_STOP); returns stdout. A failure ends the
        demo, naming the log."""
        logpath = os.path.join(self.logs, log)
        with open(logpath, "a") as err:
            r = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d",
                                self.servers.pg_url, *args], stdout=out or subprocess.PIPE,
                               stderr=err, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            self.die(f"psql {' '.join(args)} failed ({r.returncode}); see {logpath}")
        return r.stdout

    def queue_depths(self):
        """(ready in QUEUE, ready in QUEUE.dlq); -1 for a missing queue, None if the broker
        did not answer."""
        try:
            infos = self.broker.queue_infos([QUEUE, DLQ])
        except Exception as e:  # noqa: BLE001 - any broker trouble: no answer this time
            with open(os.path.join(self.logs, "queues.log"), "a") as f:
                f.write(f"{self.now():.1f}s {type(e).__name__}: {e}\n")
            return None
        return tuple(-1 if infos[q] is None else infos[q][0] for q in (QUEUE, DLQ))

    def metric_total(self, key):
        return int(sum(s.counters.total(key) for s in self.slots.values() if s.counters))

    def read_stats(self):
        """Samples the outbox, the ledger and the progress counters on one kept connection;
        self.stats is None when the database did not answer."""
        self.stats = None
        try:
            row = self.db.query(STATS_SQL.format(recov=self.recov_sql), CONSUMER)[0]
        except psycopg2.Error as e:
            with open(os.path.join(self.logs, "progress.log"), "a") as f:
                f.write(f"{self.now():.1f}s {str(e).strip()}\n")
            return
        self.st = dict(zip(STAT_KEYS, (int(v) for v in row)))
        self.stats = self.st

    def dups(self):
        return max(0, self.st["emitted"] - self.st["business"]) + self.metric_total("duplicates")

    def show_live(self):
        st = self.st
        self.o.live(self.now(), f"  {fmt_t(self.now())}  emitted {st['emitted']}/{self.n_ops} | "
                    f"pending {st['pending']} | published {st['sent']} | consumed "
                    f"{st['consumed']} | dups {self.dups()} | dead "
                    f"{self.metric_total('dead_lettered')}")

    # ------------------------------------------------------------------ setup

    def intro(self):
        o = self.o
        print(f"""{o.B}idem demo: billing events that take effect exactly once{o.RST}

A small subscription-billing app (scripts/demo/schema.sql) marks invoices paid or failed and, in
the same database transaction, queues an event with idem_emit(). Relays publish the outbox to
RabbitMQ; consumers apply each event with idem's bundled billing handlers:
  payment.failed     -> the subscription's dunning step + 1
  invoice.paid       -> one revenue entry, dunning reset to 0, and a receipt.requested event
  receipt.requested  -> one receipt ("e-mail sent")
Meanwhile about {REPLAY_PCT}% of the business operations are re-run with the same dedup key, and a
relay and a consumer are each SIGKILLed and then crash at their most awkward moment. At the
end every effect is checked against the business plan.
""", flush=True)

    def start_servers(self):
        self.o.step("[1/5] Starting private PostgreSQL 15 and RabbitMQ (about 7 s) ...")
        t = time.monotonic()
        with open(os.path.join(self.logs, "services.log"), "a") as err:
            try:
                self.servers = H.start_servers(self.svc_dir, stderr=err)
            except RuntimeError as e:
                self.die(f"could not start the servers: {e}")
        self.db = H.Db(self.servers.pg_url, keep=True, application_name="idem-demo",
                       options="-c statement_timeout=5000")
        self.broker = H.Broker(self.servers.amqp_url)
        pg_port = self.servers.pg_url.rsplit(":", 1)[1].split("/")[0]
        amqp_port = self.servers.amqp_url.rsplit(":", 1)[1].split("/")[0]
        self.o.say(f"      PostgreSQL on 127.0.0.1:{pg_port}, RabbitMQ on 127.0.0.1:{amqp_port} "
                   f"(up in {time.monotonic() - t:.0f} s)")

    def prepare(self):
        o = self.o
        o.step("[2/5] Creating the schemas and the workload")
        r = H.run_idem("migrate", "--billing", pg_url=self.servers.pg_url,
                       amqp_url=self.servers.amqp_url)
        with open(os.path.join(self.logs, "migrate.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            self.die(f"idem migrate failed; see {self.logs}/migrate.log")
        applied = sum(1 for ln in r.stdout.splitlines() if ln.startswith("applied"))
        o.say(f"      idem migrate --billing: {applied} migrations applied (schema idem: "
              "event_outbox, consumed_events, ...; schema billing: the handlers' tables)")
        self.psql("-f", os.path.join(DEMO, "schema.sql"))
        self.psql("-o", "/dev/null", "-v", f"dunning_subs={DUNNING_SUBS}",
                  "-v", f"paying_subs={PAYING_SUBS}", "-v", f"recovering_subs={RECOVERING_SUBS}",
                  "-v", f"ticks={PHASE1_TICKS}", "-v", f"replay_pct={REPLAY_PCT}",
                  "-f", os.path.join(DEMO, "plan.sql"))
        for s in (1, 2, 3):
            with open(os.path.join(self.work, f"session{s}.sql"), "w") as f:
                self.psql("-A", "-t", "-v", f"session={s}", "-f",
                          os.path.join(DEMO, "render.sql"), out=f)
        self.n_ops, self.n_replays, self.n_distinct, n_invoices = self.db.query("""
            SELECT count(*), count(*) FILTER (WHERE is_replay),
                   (SELECT count(*) FROM (SELECT DISTINCT kind, invoice_id, attempt_no
                                          FROM demo.ops) d),
                   (SELECT count(*) FROM invoices)
            FROM demo.ops""")[0]
        subs = DUNNING_SUBS + PAYING_SUBS + RECOVERING_SUBS
        d, r_ = o.DIM, o.RST
        for line in (
                f"{subs} subscriptions, {n_invoices} invoices: {DUNNING_SUBS} 'dunning' "
                f"(payments only fail), {PAYING_SUBS} 'paying'",
                f"(invoices only get paid), {RECOVERING_SUBS} 'recovering' (fail first, pay once "
                "the failures are consumed).",
                f"{self.n_distinct} business operations + {self.n_replays} replays = "
                f"{self.n_ops} transactions, each like:",
                f"{d}  BEGIN;",
                "  UPDATE invoices SET status = 'paid', paid_at = now()",
                "    WHERE invoice_id = $1 AND status <> 'paid';",
                "  SELECT idem.idem_emit('invoice.paid', subscription_id, invoice_id || ':paid', "
                "payload)",
                "    FROM invoice_events WHERE invoice_id = $1;",
                f"  COMMIT;{r_}",
                "Failed payments likewise: status 'failed', event payment.failed,",
                "dedup key invoice_id || ':failed:' || attempt_no."):
            o.say("      " + line)

    def start_daemons(self):
        o = self.o
        o.step("[3/5] Starting 2 consumers and 2 relays")
        for name in ("consumer1", "consumer2", "relay1", "relay2"):
            self.slots[name] = Slot(name, self)
        consumers = [self.slots["consumer1"], self.slots["consumer2"]]
        for s in consumers:
            s.start()
        # The consumers declare the exchange, the queue (dead-lettering through QUEUE.dlx to
        # QUEUE.dlq) and its bindings: wait until both consume before anything is published,
        # or the first messages would be unroutable.
        # The queue has a single active consumer: the broker counts the active one only, and the
        # other process stands by (it takes over when the active one dies).
        daemons = [s.daemon for s in consumers]
        try:
            H.wait_for_consumers(self.broker, [QUEUE], 1, daemons, 15)
            H.wait_for_consumers(self.broker, [DLQ], 0, daemons, 5)
            H.wait_until(lambda: all("consuming" in d.log() for d in daemons), 15, 0.1,
                         "both consumer processes subscribed", daemons)
        except AssertionError as e:
            self.die(f"the consumers did not start consuming: {str(e).splitlines()[0]} "
                     f"(see {self.logs}/consumer*.log)")
        self.slots["relay1"].start()
        self.slots["relay2"].start()
        o.say(f"      consumers: idem consume --consumer {CONSUMER} --queue {QUEUE}  "
              "(one queue: one active, the other standing by)")
        o.say("      relays:    idem relay  (two at once; they share the outbox safely)")

    # ------------------------------------------------------------------ the workload

    def start_session(self, s):
        with open(os.path.join(self.logs, f"session{s}.log"), "ab") as log:
            self.sessions[s] = subprocess.Popen(
                ["psql", "-X", "-q", "-o", "/dev/null", "-d", self.servers.pg_url, "-f",
                 os.path.join(self.work, f"session{s}.sql")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=H.die_with_parent, start_new_session=True)

    def check_procs(self):
        """A relay or consumer that died is restarted; a death the demo did not plan is
        recorded (it fails the audit)."""
        for s in self.slots.values():
            rc = s.daemon.returncode
            if s.down or rc is None:
                continue
            fault = s.fault
            if fault and rc == -signal.SIGKILL:
                point = fault.split(":")[0]
                if s.role == "relay":
                    what = "a batch confirmed by RabbitMQ but not marked sent"
                    after = "will be published again"
                else:
                    what = "a batch committed but not acked"
                    after = "will be redelivered"
                self.event(f"{self.o.YEL}{s.name} died at {point}{self.o.RST}: {what}",
                           f"{after}; {s.name} restarted",
                           kind="crash", mark=f"{s.name} crashed at {point}")
            else:
                self.unexpected.append(f"{s.name} instance {s.instances} exited with status "
                                       f"{rc} (see {s.daemon.logpath})")
                self.event(f"{self.o.RED}{s.name} exited unexpectedly with status {rc}"
                           f"{self.o.RST}; {s.name} restarted",
                           kind="exit", mark=f"{s.name} exited {rc}")
            s.retire()
            s.start()

    def kill(self, name, why):
        s = self.slots[name]
        s.scrape()
        pid = s.daemon.pid
        s.daemon.kill()
        s.down = True
        s.retire()
        self.event(f"{self.o.YEL}SIGKILL {name}{self.o.RST} (pid {pid}): {why}",
                   kind="kill", mark=f"SIGKILL {name}")

    def restart_with_fault(self, name, fault, what):
        self.slots[name].start(fault)
        self.event(f"{name} restarted with IDEM_FAULT={fault} ({what} #{fault.split(':')[1]})",
                   kind="restart", mark=f"{name} restarted, IDEM_FAULT={fault}")

    def check_sessions(self):
        """Workload sessions: an error in a business transaction stops the demo."""
        for s, p in list(self.sessions.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self.sessions[s]
            if rc != 0:
                with open(os.path.join(self.logs, f"session{s}.log"), errors="replace") as f:
                    tail = "\n".join(f.read().splitlines()[-5:])
                self.die(f"workload session {s} failed (psql status {rc}):\n{tail}")
            self.event(f"workload session {s} finished")

    def run_workload(self):
        o = self.o
        o.step(f"[4/5] Running the workload (about {PHASE1_TICKS // 10 + 5} s)")
        o.say(f"""{o.DIM}      emitted    business transactions committed (replays included)
      pending    outbox rows not yet published      published  outbox rows sent to RabbitMQ
      consumed   ledger rows (events applied)       dead       dead-lettered messages
      dups       duplicates suppressed: replays collapsed in the outbox + redeliveries ignored\
{o.RST}""")
        self.t0 = time.monotonic()
        self.start_session(1)
        self.start_session(2)
        self.event(f"workload sessions 1 and 2 started (phase 1: {PHASE1_TICKS / 10:.1f} s)")
        todo = [(T_KILL_RELAY, lambda: self.kill(
                    "relay1", "its open transaction rolls back; relay2 carries on")),
                (T_RESTART_RELAY, lambda: self.restart_with_fault(
                    "relay1", RELAY_FAULT, "dies after confirmed batch")),
                (T_KILL_CONSUMER, lambda: self.kill(
                    "consumer2", "its unacked deliveries return to the queue")),
                (T_RESTART_CONSUMER, lambda: self.restart_with_fault(
                    "consumer2", CONSUMER_FAULT, "dies after commit"))]
        phase2 = False
        draining = False
        drain_start = 0.0
        stable = 0
        last_sig = None
        while True:
            tick = time.monotonic()
            self.check_procs()
            while todo and self.now() >= todo[0][0]:
                todo.pop(0)[1]()
            for s in self.slots.values():
                s.scrape()
            self.read_stats()
            st = self.st
            if self.stats:
                self.timeline.sample(self.now(), st["emitted"], st["pending"], st["sent"],
                                     st["consumed"], st["total"])

            if (not phase2 and self.now() >= T_PHASE2_EARLIEST and self.stats
                    and st["recov_left"] == 0):
                self.start_session(3)
                phase2 = True
                self.recov_sql = "0"
                self.event(f"phase 2: every payment failure of the {RECOVERING_SUBS} "
                           "'recovering' subscriptions is consumed;", "now they pay (session 3)",
                           kind="milestone", mark="phase 2 starts")

            self.check_sessions()

            if not draining and phase2 and not self.sessions:
                draining = True
                drain_start = self.now()
                self.event(f"all {self.n_ops} transactions committed; waiting for the outbox "
                           "and the queue to drain", kind="milestone",
                           mark="all committed")
            if not draining and self.now() >= PHASE1_TICKS / 10 + 20:
                self.failed_run = True
                self.die(f"the workload did not finish within {PHASE1_TICKS / 10 + 20:.1f}s "
                         f"(phase 2 started: {int(phase2)}; {st['recov_left']} recovering "
                         "failures not consumed)")

            if draining and self.stats:
                # Drained: nothing pending, one ledger row per event, nothing ready in the
                # queue, and the consumers' counters still for a second.
                sig = (st["total"], st["consumed"], self.metric_total("applied"),
                       self.metric_total("duplicates"), self.metric_total("dead_lettered"))
                if (st["pending"] == 0 and st["consumed"] == st["total"] and sig == last_sig
                        and self.queue_depths() == (0, 0)):
                    stable += 1
                else:
                    stable = 0
                last_sig = sig
                if stable >= 2:
                    self.show_live()
                    o.end_live()
                    self.event(f"drained in {self.now() - drain_start:.1f}s after the last emit",
                               kind="milestone", mark="drained")
                    return
                if self.now() - drain_start >= DRAIN_TIMEOUT_S:
                    self.not_drained()

            self.show_live()
            # Next tick TICK_S after this one started (the work above takes part of it).
            time.sleep(max(0.05, TICK_S - (time.monotonic() - tick)))

    def not_drained(self):
        o, st = self.o, self.st
        self.show_live()
        self.failed_run = True
        o.say("")
        o.say(f"{o.RED}FAIL: not drained {DRAIN_TIMEOUT_S} s after the last emit{o.RST}: pending "
              f"{st['pending']}, failed {st['failed']}, events {st['total']}, ledger rows "
              f"{st['consumed']}, queue/dlq ready: {self.queue_depths()}")
        r = H.run_idem("status", pg_url=self.servers.pg_url, amqp_url=self.servers.amqp_url)
        for line in (r.stdout + r.stderr).splitlines():
            o.say("      " + line)
        for s in self.slots.values():
            o.say(f"---- last lines of {s.daemon.logpath}")
            for line in s.daemon.log().splitlines()[-5:]:
                o.say(line)
        raise DemoFailed("not drained")

    # ------------------------------------------------------------------ shutdown and audit

    def stop_daemons(self):
        self.o.step("[5/5] Stopping relays and consumers with SIGTERM, then auditing")
        live = [s for s in self.slots.values() if s.daemon.running()]
        for s in live:
            s.scrape()
            s.daemon.signal(signal.SIGTERM)
        for s in live:
            try:
                rc = s.daemon.wait_exit(STOP_GRACE_S)
            except AssertionError:
                self.unexpected.append(f"{s.name} did not exit within {STOP_GRACE_S} s of SIGTERM "
                                       f"(see {s.daemon.logpath})")
                s.daemon.kill()
                continue
            finally:
                s.daemon.close()
            if rc != 0 and not (rc == -signal.SIGKILL and s.fault):
                self.unexpected.append(f"{s.name} exited with status {rc} on SIGTERM "
                                       f"(see {s.daemon.logpath})")

    def audit(self):
        o = self.o
        # Anything still unacked went back to the queue when the consumers disconnected.
        depths = None
        for _ in range(5):
            depths = self.queue_depths()
            if depths == (0, 0):
                break
            time.sleep(0.3)
        q_ready, q_dlq = depths if depths else ("?", "?")
        self.read_stats()
        if not self.stats:
            self.die("the closing statistics could not be read; see "
                     f"{self.logs}/progress.log")
        st = self.st
        self.timeline.sample(self.now(), st["emitted"], st["pending"], st["sent"],
                             st["consumed"], st["total"])
        total_d = self.metric_total("duplicates")
        total_dl = self.metric_total("dead_lettered")
        collapsed = st["emitted"] - st["business"]
        e_pf, e_ip, e_rr = self.db.query("""
            SELECT count(*) FILTER (WHERE event_type = 'payment.failed'),
                   count(*) FILTER (WHERE event_type = 'invoice.paid'),
                   count(*) FILTER (WHERE event_type = 'receipt.requested') FROM idem.event_outbox""")[0]
        lines = self.psql("-A", "-t", "-F", "\t", "-v", f"consumer={CONSUMER}", "-f",
                          os.path.join(DEMO, "audit.sql"), log="audit.log")
        checks = []
        for line in lines.splitlines():
            if line.strip():
                _, ok, text, detail = line.split("\t", 3)
                checks.append((ok == "t", text, detail))
        checks.append((q_ready == 0 and q_dlq == 0 and total_dl == 0,
                       f"broker: {QUEUE} drained, nothing dead-lettered",
                       f"{q_ready} messages left in {QUEUE}, {q_dlq} in {DLQ}; consumers "
                       f"dead-lettered {total_dl}"))
        inst = {n: s.instances for n, s in self.slots.items()}
        checks.append((not self.unexpected,
                       "processes: no unplanned exits; all stopped cleanly on SIGTERM",
                       f"relay1: {inst['relay1']} instances, relay2: {inst['relay2']}, consumer1: "
                       f"{inst['consumer1']}, consumer2: {inst['consumer2']}"
                       if not self.unexpected else "; ".join(self.unexpected)))

        row = lambda k, v, t: o.say(f"  {k:<23}{v:>6}  {t}")  # noqa: E731
        more = lambda t: o.say(f"{'':33}{t}")  # noqa: E731
        o.say("")
        o.say(f"{o.B}Closing report{o.RST}")
        row("emitted", st["emitted"], f"business transactions: {self.n_distinct} operations + "
            f"{self.n_replays} replays")
        row("events in the outbox", st["total"], f"{e_pf} payment.failed, {e_ip} invoice.paid,")
        more(f"{e_rr} receipt.requested (emitted by the invoice.paid handler)")
        row("published", st["sent"], "outbox rows sent, confirmed by RabbitMQ")
        row("consumed", st["consumed"], "ledger rows: events applied")
        row("duplicates suppressed", collapsed + total_d,
            f"{collapsed} replays collapsed in the outbox,")
        more(f"at least {total_d} redelivered messages skipped by the ledger")
        row("dead-lettered", total_dl, f"the dead-letter queue holds {q_dlq} messages")
        row("faults injected", "", f"relay1: SIGKILL, then a crash at {RELAY_FAULT.split(':')[0]}")
        more(f"consumer2: SIGKILL, then a crash at {CONSUMER_FAULT.split(':')[0]}")
        o.say("")
        o.say(f"{o.B}Audit{o.RST}")
        for ok, text, detail in checks:
            o.say(f"  {o.GRN}PASS{o.RST}  {text}" if ok else f"  {o.RED}FAIL{o.RST}  {text}")
            if detail:
                o.say(f"        {o.DIM}{detail}{o.RST}")
        fails = sum(not ok for ok, _, _ in checks)
        o.say("")
        self.draw_timeline(st, fails)
        if fails == 0:
            o.say(f"{o.GRN}{o.B}PASS{o.RST}: every event took effect exactly once "
                  f"({time.monotonic() - self.started:.0f} s).")
            return True
        self.failed_run = True
        o.say(f"{o.RED}{o.B}FAIL{o.RST}: {fails} audit line(s) failed; logs: {self.logs}")
        return False

    def draw_timeline(self, st, fails):
        tl = self.timeline
        title = (f"make demo: {st['total']} events through 2 relays and 2 consumers; "
                 f"{tl.count('kill')} SIGKILLs, {tl.count('crash')} crashes at fault seams, "
                 f"{tl.count('exit')} unplanned exits - audit "
                 + ("PASS" if fails == 0 else f"FAIL ({fails} lines)"))
        try:
            svg = self.timeline.draw(self.a.out, title)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            self.o.say(f"Timeline not drawn: {e}")
            return
        rel = os.path.relpath(svg, os.getcwd())
        self.o.say(f"Timeline: {svg if rel.startswith('..') else rel} (pending, published and "
                   "consumed events over time; faults marked)")

    # ------------------------------------------------------------------ cleanup

    def cleanup(self, keep):
        self.o.end_live()
        for s in self.slots.values():
            s.daemon.kill()
        for p in self.sessions.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        if self.db is not None:
            self.db.close()
        if os.path.exists(os.path.join(self.svc_dir, "state.sh")):
            sys.stdout.write(f"{self.o.CLR}stopping PostgreSQL and RabbitMQ ...")
            sys.stdout.flush()
            with open(os.path.join(self.logs, "services.log"), "a") as f:
                subprocess.run([H.SERVICES, "stop", self.svc_dir], stdout=f, stderr=f,
                               stdin=subprocess.DEVNULL, timeout=120)
            print(" stopped.", flush=True)
        if keep:
            self.o.say(f"logs kept in {self.logs} (remove {self.work} when done)")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def execute(self):
        self.intro()
        self.start_servers()
        self.prepare()
        self.start_daemons()
        self.run_workload()
        self.stop_daemons()
        return self.audit()


def main(argv):
    ap = argparse.ArgumentParser(prog="demo", description="idem's end-to-end demo: a billing "
                                 "scenario with crashes, then an exactly-once audit.")
    ap.add_argument("--keep", action="store_true",
                    default=os.environ.get("IDEM_DEMO_KEEP", "0") == "1",
                    help="keep the temporary directory (logs, data); also IDEM_DEMO_KEEP=1")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "demo"),
                    help="where the timeline goes (timeline.svg, .dat, .gp; default build/demo)")
    a = ap.parse_args(argv)
    a.out = os.path.abspath(a.out)
    if os.geteuid() != 0:
        sys.exit("demo: run as root: the private PostgreSQL runs as user postgres (via runuser)")
    if not os.access(H.IDEM, os.X_OK):
        sys.exit(f"demo: {H.IDEM} not found: run 'make' first (or 'make demo', which also "
                 "installs deps)")
    if shutil.which("psql") is None:
        sys.exit("demo: psql not found: run scripts/deps.sh (package postgresql-15)")

    run = Run(a)

    def on_signal(sig, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(128 + sig)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    status = 1
    try:
        status = 0 if run.execute() else 1
    except Interrupted as e:
        run.o.say(f"{run.o.YEL}interrupted; stopping everything{run.o.RST}")
        status = e.status
    except DemoFailed as e:
        if str(e) != "not drained":
            run.o.say(f"{run.o.RED}demo: {e}{run.o.RST}")
        run.failed_run = True
    except Exception as e:  # noqa: BLE001 - shown, logs kept
        run.o.say(f"{run.o.RED}demo: {type(e).__name__}: {e}{run.o.RST}")
        import traceback
        with open(os.path.join(run.logs, "demo.log"), "a") as f:
            f.write(traceback.format_exc())
        run.failed_run = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run.cleanup(keep=a.keep or run.failed_run or status not in (0, 130, 143, 129))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
