"""The faults of a chaos run: which kinds exist, when each is injected (from the seed), and how.

Process faults (kills and restarts at a fault seam) run on the main thread: daemons are
started there, so that they die with the run whatever kills it (PR_SET_PDEATHSIG follows the
thread that forked). Faults that last (server restarts, a frozen link, a held lock, a SQLSTATE
window) run in a thread each; the schedule starts them and goes on.
"""

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter

import psycopg2

# kind -> (group, what it does)
KINDS = {
    "kill-relay": ("process", "SIGKILL a relay, restart it"),
    "kill-consumer": ("process", "SIGKILL a consumer (the active one, mostly), restart it"),
    "seam-before-commit": ("process", "restart a consumer with IDEM_FAULT=consumer.before_commit:N"),
    "seam-after-commit": ("process", "restart a consumer with IDEM_FAULT=consumer.after_commit:N"),
    "seam-after-publish": ("process", "restart a relay with IDEM_FAULT=relay.after_publish:N"),
    "pg-restart": ("server", "pg_ctl -m immediate stop, then start PostgreSQL (once)"),
    "stop-relay": ("process", "SIGSTOP a relay for 3-8 s, then SIGCONT"),
    "rmq-restart": ("server", "stop, then start RabbitMQ while the work queues hold a backlog "
                              "(the consumers' links frozen until it builds up; once)"),
    "freeze-resume": ("link", "freeze a daemon's AMQP link for 2-8 s, then resume it"),
    "freeze-drop": ("link", "freeze a daemon's AMQP link for 2-8 s, then reset it"),
    "half-open-reset": ("link", "freeze a daemon's AMQP link past its heartbeat timeout while "
                                "the proxy keeps the broker's side alive (the broker keeps the "
                                "old connection's unacked deliveries as the daemon reconnects), "
                                "then reset it"),
    "pg-cancel": ("db", "pg_cancel_backend on a busy idem connection"),
    "pg-terminate": ("db", "pg_terminate_backend on an idem connection"),
    "lock-outbox": ("db", "LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE for 7 s"),
    "sqlstate-25006": ("db", "idem's writes fail with SQLSTATE 25006 (read-only) for 2-4 s"),
    "sqlstate-53100": ("db", "idem's writes fail with SQLSTATE 53100 (disk full) for 2-4 s"),
}
ONCE = {"pg-restart", "rmq-restart"}
# Relative frequency once every kind has had its turn.
WEIGHTS = {"kill-relay": 3, "kill-consumer": 3, "seam-before-commit": 1, "seam-after-commit": 2,
           "seam-after-publish": 2, "stop-relay": 1, "freeze-resume": 1, "freeze-drop": 1,
           "half-open-reset": 2, "pg-cancel": 2, "pg-terminate": 2, "lock-outbox": 1,
           "sqlstate-25006": 1, "sqlstate-53100": 1}
# Kinds aimed at a daemon's link, taken by a consumer and by a relay in turn: so each run hits
# both roles, the kind's first turns come this many times at least.
LINK_KINDS = ("freeze-resume", "freeze-drop", "half-open-reset")
MIN_TURNS = {k: 2 for k in LINK_KINDS}
BACKLOG_WAIT_S = 12.0  # longest rmq-restart waits for its backlog with the consumers frozen
HALF_OPEN_MAX_S = 30.0  # longest half-open-reset waits for the daemon to reconnect
REJOIN_S = 2.0  # and how long it then leaves the new connection beside the half-open one
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
            out |= set(KINDS)
        elif word in KINDS:
            out.add(word)
        elif word in {g for g, _ in KINDS.values()}:
            out |= {k for k, (g, _) in KINDS.items() if g == word}
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
        self.backlog = None  # rmq-restart: messages ready in the work queues at the stop
        self.thread = None

    def over(self):
        return self.ended is not None


def schedule(seed, kinds, window, min_gap=1.0, max_gap=3.0, first=2.0):
    """Faults every min_gap..max_gap s from `first` until `window`, and on until every kind in
    `kinds` had its turn: each kind once (MIN_TURNS) in random order first, then by WEIGHTS."""
    rng = random.Random(f"faults-{seed}")
    todo = [k for k in sorted(kinds) for _ in range(MIN_TURNS.get(k, 1))]
    rng.shuffle(todo)
    # rmq-restart needs a backlog, so traffic: its turn comes in the first half of the window
    # (turns are 2 s apart on average).
    if "rmq-restart" in todo:
        todo.remove("rmq-restart")
        todo.insert(rng.randrange(max(1, min(len(todo), int(window / 4)))), "rmq-restart")
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
    """Injects faults into a run. `run` gives: servers, procs (name -> daemon slot: role,
    recent, stopped), listeners (name -> proxy Listener), heartbeat_s, backlog_target,
    queue_depths(), stop_flag, now(), event(text), admin_conn(), set_fault_sqlstate(code),
    backend_owners(), and the main-thread process actions pick_proc, kill_proc and
    restart_proc."""

    def __init__(self, run, seed):
        self.run = run
        self.rng = random.Random(f"inject-{seed}")
        self.active = Counter()  # kinds of faults in progress (threads), with their numbers
        self.busy_links = set()  # names of the daemons whose link a fault holds
        self.lock = threading.Lock()
        self.threads = []
        self.turns = Counter()  # link faults injected so far, by kind

    def pause(self, seconds):
        """Sleeps; True if the run is being stopped meanwhile (the fault then ends early)."""
        return self.run.stop_flag.wait(seconds)

    def join(self, timeout=60):
        """Waits for the fault threads (at the end of the run, before the servers stop)."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ readiness

    def active_kinds(self):
        with self.lock:
            return {k for k, n in self.active.items() if n > 0}

    def blocked(self, kind):
        """Whether kind must wait however long it has waited: the same kind, or a restart of the
        server it needs, is in progress (RabbitMQ's can take a minute with a backlog)."""
        active = self.active_kinds()
        group = KINDS[kind][0]
        return kind in active or (group == "link" and "rmq-restart" in active) or (
            group == "db" and "pg-restart" in active) or (
            kind == "rmq-restart" and bool(active & set(LINK_KINDS)))

    def ready(self, kind):
        """Whether kind may start now; a fault that may not waits (and the ones behind it)."""
        active = self.active_kinds()
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
        if group == "link" and ("rmq-restart" in active or not self.link_names()):
            return False
        if group == "link" and self.link_role(kind) == "consumer" and not self.link_names(
                "consumer"):
            return False  # a consumer's turn, and none is connected now
        if kind == "rmq-restart" and active & set(LINK_KINDS):
            return False
        if group == "process":
            if kind.startswith("seam-") and "pg-restart" in active:
                return False  # a graceful stop needs its server
            role = "relay" if kind in ("kill-relay", "seam-after-publish", "stop-relay") \
                else "consumer"
            min_age = 2.0 if kind.startswith("seam-") else 0.0
            if self.run.pick_proc(role, random.Random(0), min_age) is None:
                return False  # every daemon of the role is restarting
        return True

    def idle(self):
        with self.lock:
            return not any(self.active.values())

    # ------------------------------------------------------------------ injection

    def inject(self, f):
        f.started = time.monotonic()
        f.started_at = self.run.now()
        handler = {"kill": self._kill, "seam": self._seam, "stop": self._stop, "pg": self._pg,
                   "rmq": self._rmq, "freeze": self._freeze, "half": self._freeze,
                   "lock": self._lock, "sqlstate": self._sqlstate}[f.kind.split("-")[0]]
        handler(f)

    def _in_thread(self, f, body):
        with self.lock:
            self.active[f.kind] += 1

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
                    self.active[f.kind] -= 1
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
        """Freezes the consumers' links (and holds their new ones frozen) until the work queues
        hold a backlog, stops RabbitMQ with it, then resets those links and starts RabbitMQ."""
        lns = [self.run.listeners[n] for n, p in sorted(self.run.procs.items())
               if p.role == "consumer"]
        target = self.run.backlog_target
        try:
            for ln in lns:
                ln.hold(True)
                ln.freeze()
            t0 = time.monotonic()
            while True:
                depth = self.run.queue_depths()
                if sum(depth.values()) >= target or time.monotonic() - t0 > BACKLOG_WAIT_S:
                    break
                if self.pause(0.3):
                    return
            t1 = time.monotonic()
            self.run.servers.rmq_stop()
        finally:
            for ln in lns:
                ln.hold(False)
                ln.drop(ln.open_links())
        ready = sum(depth.values())
        f.backlog = ready
        self.run.event(f"RabbitMQ stopped with {ready} messages ready in the work queues ("
                       + ", ".join(f"{q.rsplit('.', 1)[1]} {n}" for q, n in depth.items())
                       + f"; consumers' links frozen {t1 - t0:.1f} s)")
        if self.pause(self.rng.uniform(1.0, 3.0)):
            return
        self.run.servers.rmq_start()
        f.detail = f"{ready} ready at the stop, down {time.monotonic() - t1:.1f} s"
        if ready == 0:
            f.ok = False
            f.detail += "; no backlog"

    # processes stopped and continued

    def _stop(self, f):
        p = self.run.pick_proc("relay", self.rng)
        if p is None:
            f.detail = "no running relay"
            return self._done(f, False)
        hold = self.rng.uniform(3.0, 8.0)
        pid = p.pid()
        f.target = p.name
        p.stopped = True
        os.kill(pid, signal.SIGSTOP)

        def body(f):
            try:
                self.pause(hold)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                p.stopped = False
            f.detail = f"pid {pid} SIGSTOP, SIGCONT {hold:.1f} s later"

        self._in_thread(f, body)

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

    def link_role(self, kind):
        """The role whose link this turn of kind freezes: a consumer, then a relay, then any."""
        n = self.turns[kind]
        return ("consumer", "relay")[n] if n < 2 else None

    def link_names(self, role=None):
        """Daemons of role (any: None) with an open link that no other fault holds."""
        return sorted(n for n, ln in self.run.listeners.items()
                      if ln.open_links() and n not in self.busy_links
                      and role in (None, self.run.procs[n].role))

    def _freeze(self, f):
        role = self.link_role(f.kind)
        self.turns[f.kind] += 1
        names = self.link_names(role) or self.link_names()
        if not names:
            f.detail = "no open AMQP link"
            return self._done(f, False)
        # A daemon that did work lately (the active consumer) three times as often.
        weights = [3 if self.run.procs[n].recent > 0 else 1 for n in names]
        name = self.rng.choices(names, weights)[0]
        hb = self.run.heartbeat_s
        keepalive = None
        if f.kind == "half-open-reset":
            # Past the daemon's two heartbeats, so it reconnects while the broker keeps the
            # old connection (heartbeats forged at half the interval).
            hold = (3 * hb if hb else 6.0) + self.rng.uniform(1.0, 3.0)
            keepalive = max(0.5, (hb or 2.0) / 2)
        else:
            hold = self.rng.uniform(2.0, 8.0)
        drop = f.kind != "freeze-resume"
        f.target = f"{name}'s link"

        self.busy_links.add(name)

        def body(f):
            try:
                hold_link(f)
            finally:
                self.busy_links.discard(name)

        def hold_link(f):
            listener = self.run.listeners[name]
            accepted = listener.accepted
            t0 = time.monotonic()
            links = listener.freeze(keepalive)
            if not links:
                raise RuntimeError("no open connection to freeze")
            again_at = None
            # Half-open: held at least `hold`, and until the daemon has reconnected (its
            # reconnect may back off) and had REJOIN_S on the new connection, HALF_OPEN_MAX_S
            # at most.
            while not self.pause(0.2):
                now = time.monotonic()
                if again_at is None and listener.accepted > accepted:
                    again_at = now
                if now - t0 >= hold and (not keepalive or not hb or now - t0 >= HALF_OPEN_MAX_S
                                         or (again_at and now - again_at >= REJOIN_S)):
                    break
            again = listener.accepted - accepted
            if drop:
                listener.drop(links)
            else:
                listener.resume(links)
            how = "half-open" if keepalive else "frozen"
            f.detail = f"{len(links)} connection(s) {how} {time.monotonic() - t0:.1f} s, then " + \
                ("reset" if drop else "resumed")
            if keepalive:
                f.detail += f" ({sum(ln.heartbeats_sent for ln in links)} heartbeats forged; " + (
                    f"reconnected {again_at - t0:.1f} s in, {again} new connection(s))"
                    if again_at else "no new connection)")
                if again == 0 and hb:
                    f.ok = False
                    f.detail += f"; the daemon did not reconnect in {HALF_OPEN_MAX_S:g} s"

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
                    cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
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
