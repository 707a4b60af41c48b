"""The faults of a chaos run: which kinds exist, when each is injected (from the seed), and how.

Process faults (kills and restarts at a fault seam) run on the main thread: daemons are
started there, so that they die with the run whatever kills it (PR_SET_PDEATHSIG follows the
thread that forked). Faults that last (server restarts, a frozen link, a held lock, a SQLSTATE
window) run in a thread each; the schedule starts them and goes on.
"""

import random
import threading
import time

import pika
import psycopg2

# kind -> (group, what it does)
KINDS = {
    "kill-relay": ("process", "SIGKILL a relay, restart it"),
    "kill-consumer": ("process", "SIGKILL a consumer (the active one, mostly), restart it"),
    "seam-before-commit": ("process", "restart a consumer with IDEM_FAULT=consumer.before_commit:N"),
    "seam-after-commit": ("process", "restart a consumer with IDEM_FAULT=consumer.after_commit:N"),
    "seam-after-publish": ("process", "restart a relay with IDEM_FAULT=relay.after_publish:N"),
    "pg-restart": ("server", "pg_ctl -m immediate stop, then start PostgreSQL (once)"),
    "rmq-restart": ("server", "stop, then start RabbitMQ (once)"),
    "ring-move": ("server", "bind the partitions to the hash exchange again in another order: "
                            "subscriptions move between partitions, as after a RabbitMQ restart "
                            "(only when named: with backlogs it can stall the group, README "
                            "'When the broker moves a subscription')"),
    "freeze-resume": ("link", "freeze a daemon's AMQP link for 2-8 s, then resume it"),
    "freeze-drop": ("link", "freeze a daemon's AMQP link for 2-8 s, then reset it"),
    "pg-cancel": ("db", "pg_cancel_backend on a busy idem connection"),
    "pg-terminate": ("db", "pg_terminate_backend on an idem connection"),
    "lock-outbox": ("db", "LOCK TABLE event_outbox IN ACCESS EXCLUSIVE MODE for 7 s"),
    "sqlstate-25006": ("db", "idem's writes fail with SQLSTATE 25006 (read-only) for 2-4 s"),
    "sqlstate-53100": ("db", "idem's writes fail with SQLSTATE 53100 (disk full) for 2-4 s"),
}
ONCE = {"pg-restart", "rmq-restart"}
# Relative frequency once every kind has had its turn.
WEIGHTS = {"kill-relay": 3, "kill-consumer": 3, "seam-before-commit": 1, "seam-after-commit": 2,
           "seam-after-publish": 2, "freeze-resume": 1, "freeze-drop": 1, "pg-cancel": 2,
           "pg-terminate": 2, "lock-outbox": 1, "sqlstate-25006": 1, "sqlstate-53100": 1,
           "ring-move": 1}
LOCK_HOLD_S = 7.0  # longer than the daemons' lock timeout (5 s)
# How long the LOCK statement itself may wait: longer than the daemons' lock timeout, so that a
# daemon blocked behind the queued request times out and lets it through, as with a real DDL.
LOCK_WAIT_S = 20


# pid, client_port, state, query (shortened), application_name
BACKENDS_SQL = ("SELECT pid, client_port, state, left(regexp_replace(query, '\\s+', ' ', 'g'), 40),"
                " application_name FROM pg_stat_activity")


def first_line(e):
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# Kinds that "all" and the groups leave out: they are run by name.
OPT_IN = {"ring-move"}


def parse_kinds(spec):
    """'all', 'none', or a comma list of kinds and groups (process, server, link, db);
    returns the set of kinds, or raises ValueError."""
    spec = spec.strip()
    if spec in ("", "none"):
        return set()
    out = set()
    for word in spec.split(","):
        word = word.strip()
        if word == "all":
            out |= set(KINDS) - OPT_IN
        elif word in KINDS:
            out.add(word)
        elif word in {g for g, _ in KINDS.values()}:
            out |= {k for k, (g, _) in KINDS.items() if g == word} - OPT_IN
        else:
            raise ValueError(f"unknown fault kind or group {word!r}")
    return out


class Fault:
    """One planned fault; filled in when injected (target, detail, start/end, ok)."""

    def __init__(self, at, kind):
        self.at = at  # planned time, seconds after the workload started
        self.kind = kind
        self.started = None
        self.started_at = None  # seconds after the workload started
        self.ended = None
        self.target = ""
        self.detail = ""
        self.ok = None  # True: injected as planned; False: could not be (detail says why)
        self.refused = None  # writes refused during a SQLSTATE window
        self.thread = None

    def over(self):
        return self.ended is not None


def schedule(seed, kinds, window, min_gap=1.0, max_gap=3.0, first=2.0):
    """Faults every min_gap..max_gap s from `first` until `window`, and on until every kind in
    `kinds` had its turn: each kind once in random order first, then by WEIGHTS."""
    rng = random.Random(f"faults-{seed}")
    todo = sorted(kinds)
    rng.shuffle(todo)
    repeat = [k for k in sorted(kinds) if k not in ONCE]
    out, t = [], first
    while t <= window or todo:
        if todo:
            kind = todo.pop(0)
        elif repeat:
            kind = rng.choices(repeat, [WEIGHTS[k] for k in repeat])[0]
        else:
            break
        out.append(Fault(round(t, 2), kind))
        t += rng.uniform(min_gap, max_gap)
    return out


class Injector:
    """Injects faults into a run. `run` gives: servers, listeners (name -> proxy Listener),
    stop_flag, now(), event(text), admin_conn(), set_fault_sqlstate(code), backend_owners(),
    and the main-thread process actions pick_proc, kill_proc and restart_proc."""

    def __init__(self, run, seed):
        self.run = run
        self.rng = random.Random(f"inject-{seed}")
        self.active = set()  # kinds of faults in progress (threads)
        self.lock = threading.Lock()
        self.threads = []

    def pause(self, seconds):
        """Sleeps; True if the run is being stopped meanwhile (the fault then ends early)."""
        return self.run.stop_flag.wait(seconds)

    def join(self, timeout=60):
        """Waits for the fault threads (at the end of the run, before the servers stop)."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ readiness

    def ready(self, kind):
        """Whether kind may start now; a fault that may not waits (and the ones behind it)."""
        with self.lock:
            active = set(self.active)
        if kind in active:
            return False
        group = KINDS[kind][0]
        db_active = {k for k in active if KINDS[k][0] == "db"}
        if group == "db" and "pg-restart" in active:
            return False
        if kind == "pg-restart" and db_active:
            return False
        # The two SQLSTATEs share one switch; and a window inside the outbox lock would find
        # no traffic to refuse.
        if kind.startswith("sqlstate-") and db_active & {"sqlstate-25006", "sqlstate-53100",
                                                         "lock-outbox"}:
            return False
        if kind == "lock-outbox" and db_active & {"sqlstate-25006", "sqlstate-53100"}:
            return False
        if group == "link" and ("rmq-restart" in active or
                                not any(ln.open_links() for ln in self.run.listeners.values())):
            return False
        if kind == "rmq-restart" and active & {"freeze-resume", "freeze-drop", "ring-move"}:
            return False
        if kind == "ring-move" and "rmq-restart" in active:
            return False  # it needs the broker
        if group == "process":
            if kind.startswith("seam-") and "pg-restart" in active:
                return False  # a graceful stop needs its server
            role = "relay" if kind in ("kill-relay", "seam-after-publish") else "consumer"
            min_age = 2.0 if kind.startswith("seam-") else 0.0
            if self.run.pick_proc(role, random.Random(0), min_age) is None:
                return False  # every daemon of the role is restarting
        return True

    def idle(self):
        with self.lock:
            return not self.active

    # ------------------------------------------------------------------ injection

    def inject(self, f):
        f.started = time.monotonic()
        f.started_at = self.run.now()
        handler = {"kill": self._kill, "seam": self._seam, "pg": self._pg, "rmq": self._rmq,
                   "freeze": self._freeze, "lock": self._lock, "ring": self._ring,
                   "sqlstate": self._sqlstate}[f.kind.split("-")[0]]
        handler(f)

    def _in_thread(self, f, body):
        with self.lock:
            self.active.add(f.kind)

        def main():
            try:
                body(f)
                if f.ok is None:
                    f.ok = True
            except Exception as e:  # a fault that could not be injected is reported, not fatal
                f.ok = False
                f.detail = (f.detail + "; " if f.detail else "") + f"failed: {first_line(e)}"
            finally:
                f.ended = time.monotonic()
                with self.lock:
                    self.active.discard(f.kind)
                self.run.event(f"{f.kind} over: {f.target} {f.detail}".rstrip())

        f.thread = threading.Thread(target=main, name=f.kind, daemon=True)
        self.threads.append(f.thread)
        f.thread.start()

    def _done(self, f, ok=True):
        f.ok = ok
        f.ended = time.monotonic()

    # process faults (main thread)

    def _kill(self, f):
        role = "relay" if f.kind == "kill-relay" else "consumer"
        p = self.run.pick_proc(role, self.rng)
        if p is None:
            f.detail = f"no running {role}"
            return self._done(f, False)
        f.target = p.name
        f.detail = f"pid {p.pid()}"
        self.run.kill_proc(p)
        self._done(f)

    def _seam(self, f):
        point, role = {"seam-before-commit": ("consumer.before_commit", "consumer"),
                       "seam-after-commit": ("consumer.after_commit", "consumer"),
                       "seam-after-publish": ("relay.after_publish", "relay")}[f.kind]
        # SIGTERM only a daemon that has been up a while: one hit before it installed its
        # signal handler just dies of the signal, which says nothing about idem.
        p = self.run.pick_proc(role, self.rng, min_age=2.0)
        if p is None:
            f.detail = f"no {role} up for 2 s"
            return self._done(f, False)
        fault = f"{point}:{self.rng.randint(1, 25)}"
        f.target = p.name
        f.detail = f"SIGTERM pid {p.pid()}, restart with IDEM_FAULT={fault}"
        self.run.restart_proc(p, fault)
        self._done(f)

    # servers

    def _pg(self, f):
        if f.kind == "pg-restart":
            f.target = "PostgreSQL"
            return self._in_thread(f, self._pg_restart)
        f.target = "an idem backend"
        if f.kind == "pg-cancel":
            return self._in_thread(f, lambda f: self._backend(f, "pg_cancel_backend"))
        return self._in_thread(f, lambda f: self._backend(f, "pg_terminate_backend"))

    def _pg_restart(self, f):
        t0 = time.monotonic()
        self.run.servers.pg_stop_immediate()
        self.run.event("PostgreSQL stopped (immediate)")
        if self.pause(self.rng.uniform(1.0, 3.0)):
            return
        self.run.servers.pg_start()
        f.detail = f"down {time.monotonic() - t0:.1f} s"

    def _rmq(self, f):
        f.target = "RabbitMQ"
        self._in_thread(f, self._rmq_restart)

    def _rmq_restart(self, f):
        t0 = time.monotonic()
        self.run.servers.rmq_stop()
        self.run.event("RabbitMQ stopped")
        if self.pause(self.rng.uniform(1.0, 3.0)):
            return
        self.run.servers.rmq_start()
        f.detail = f"down {time.monotonic() - t0:.1f} s"

    def _ring(self, f):
        parts = self.run.work_queues
        f.target = parts[0].rsplit(".p", 1)[0] + ".hash"
        if len(parts) < 2:
            f.detail = "no partitions"
            return self._done(f, False)
        self._in_thread(f, self._ring_move)

    def _ring_move(self, f):
        """Unbinds every partition from the hash exchange and binds them again in a new order:
        the ring numbers its buckets in binding order, so subscriptions change partition."""
        parts = self.run.work_queues
        current = getattr(self, "ring_order", sorted(parts))
        order = list(current)
        while order == current:
            self.rng.shuffle(order)
        conn = pika.BlockingConnection(pika.URLParameters(self.run.servers.amqp_url))
        try:
            ch = conn.channel()
            for q in parts:
                ch.queue_unbind(q, f.target, routing_key="1")
            for q in order:
                ch.queue_bind(q, f.target, routing_key="1")
        finally:
            conn.close()
        self.ring_order = order
        f.detail = "partitions bound in the order " + ", ".join(q.rsplit(".", 1)[1] for q in order)

    def _backend(self, f, func):
        """Cancels or terminates an idem backend, preferring one inside a statement or a
        transaction (polled for up to 2 s), else any idem backend."""
        rng = random.Random(self.rng.random())
        with self.run.admin_conn() as conn, conn.cursor() as cur:
            deadline = time.monotonic() + 2.0
            while True:
                cur.execute(BACKENDS_SQL + " WHERE application_name LIKE 'idem%'"
                            " AND datname = current_database()")
                rows = cur.fetchall()
                # A cancel only affects a running statement; a termination any session.
                states = ("active",) if func == "pg_cancel_backend" else \
                    ("active", "idle in transaction")
                busy = [r for r in rows if r[2] in states]
                if busy or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            pick = busy or rows
            if not pick:
                raise RuntimeError("no idem backend connected")
            row = rng.choice(pick)
            cur.execute(f"SELECT {func}(%s)", (row[0],))
            done = cur.fetchone()[0]
        f.target = self.describe([row])
        if not done:
            f.ok = False
            f.detail = f"{func} returned false"

    def describe(self, rows):
        """'backend PID of DAEMON (state: query)', ... for rows of BACKENDS_SQL."""
        owners = self.run.backend_owners()
        return "; ".join(f"backend {pid} of {owners.get(port, app or '?')} "
                         f"({state or 'connecting'}: {query!r})"
                         for pid, port, state, query, app in rows)

    # the AMQP link

    def _freeze(self, f):
        names = [n for n, ln in self.run.listeners.items() if ln.open_links()]
        if not names:
            f.detail = "no open AMQP link"
            return self._done(f, False)
        name = self.rng.choice(sorted(names))
        hold = self.rng.uniform(2.0, 8.0)
        drop = f.kind == "freeze-drop"
        f.target = f"{name}'s link"

        def body(f):
            listener = self.run.listeners[name]
            links = listener.freeze()
            f.detail = f"{len(links)} connection(s) frozen {hold:.1f} s, then " + \
                ("reset" if drop else "resumed")
            if not links:
                raise RuntimeError("no open connection to freeze")
            self.pause(hold)
            if drop:
                listener.drop(links)
            else:
                listener.resume(links)

        self._in_thread(f, body)

    # PostgreSQL-side faults

    def _lock(self, f):
        f.target = "event_outbox"

        def body(f):
            with self.run.admin_conn(autocommit=False) as conn, conn.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                pid = cur.fetchone()[0]
                cur.execute(f"SET lock_timeout = '{LOCK_WAIT_S}s'")
                blockers = []
                watch = threading.Thread(target=self._blockers, args=(pid, blockers), daemon=True)
                t0 = time.monotonic()
                watch.start()
                try:
                    cur.execute("LOCK TABLE event_outbox IN ACCESS EXCLUSIVE MODE")
                except psycopg2.Error:
                    f.detail = f"not granted in {LOCK_WAIT_S} s; blocked by " + (
                        "; ".join(b for b in blockers if b) or "?")
                    raise
                finally:
                    waited = time.monotonic() - t0
                    blockers.append(None)  # stops the watcher
                self.pause(LOCK_HOLD_S)
                conn.commit()
            f.detail = f"ACCESS EXCLUSIVE held {LOCK_HOLD_S:.0f} s (waited {waited:.1f} s for it)"

        self._in_thread(f, body)

    def _blockers(self, pid, out):
        """After 2 s of waiting, records which backends block pid, and which idem backends
        wait for a lock on event_outbox (behind the request)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if out:
                return
            time.sleep(0.1)
        try:
            with self.run.admin_conn() as conn, conn.cursor() as cur:
                cur.execute(BACKENDS_SQL + " WHERE pid = ANY (pg_blocking_pids(%s))", (pid,))
                blocking = cur.fetchall()
                cur.execute(BACKENDS_SQL + " WHERE application_name LIKE 'idem%'"
                            " AND wait_event_type = 'Lock'")
                waiting = cur.fetchall()
        except psycopg2.Error:
            return
        if not out:
            out.append(self.describe(blocking) or "-")
            if waiting:
                out.append("waiting behind the request: " + self.describe(waiting))

    def _sqlstate(self, f):
        code = f.kind.split("-")[1]
        hold = self.rng.uniform(2.0, 4.0)
        f.target = "triggers on dunning, revenue_entries, receipts, event_outbox"

        def body(f):
            before = self.run.set_fault_sqlstate(code)
            try:
                self.pause(hold)
            finally:
                # Must not stay set: retry until cleared.
                deadline = time.monotonic() + 60
                while True:
                    try:
                        after = self.run.set_fault_sqlstate(None)
                        break
                    except psycopg2.Error:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
            f.refused = after - before
            f.detail = f"SQLSTATE {code} for {hold:.1f} s, {f.refused} writes refused"

        self._in_thread(f, body)
