"""The relay's wake-up does not cost emitters a NOTIFY per event (README "How it works").

A NOTIFY makes PostgreSQL commit notifying transactions one at a time, so idem_emit notifies
only while a relay says it is idle (a row of idem_relay_idle). A busy relay polls every 1-4 ms;
a relay that found nothing for a quarter of a second writes its idle row and waits for a NOTIFY.
An emitter that called idem_emit before the idle row was there and committed after the relay's
last look is found by a poll: the relay goes on polling once idle, the interval doubling up to
--poll-interval, so a missed wake-up costs about as long again as that transaction ran on after
the relay went idle, and at most one poll interval. These tests run a real relay and count the
NOTIFYs a listener sees."""

import select
import threading
import time

from conftest import new_id, payload, wait_until
from relay_helpers import declare_consumer_queue, emit, relay_daemons

__all__ = ["relay_daemons"]


def idle_rows(db):
    return db.count("idem.idem_relay_idle")


def sent_at_latency(db, event_id, t_commit, timeout=10):
    """Seconds from t_commit (time.time()) until the row of event_id is marked sent."""
    wait_until(lambda: db.scalar("SELECT status FROM idem.event_outbox WHERE event_id = %s::uuid",
                                 event_id) == "sent", timeout, 0.005,
               f"event {event_id} sent")
    sent = db.scalar("SELECT extract(epoch FROM sent_at) FROM idem.event_outbox"
                     " WHERE event_id = %s::uuid", event_id)
    return float(sent) - t_commit


class Listener:
    """Counts NOTIFYs on idem_outbox in a thread."""

    def __init__(self, db):
        self.cm = db.connect()
        self.conn = self.cm.__enter__()
        with self.conn.cursor() as cur:
            cur.execute("LISTEN idem_outbox")
        self.count = 0
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            if select.select([self.conn], [], [], 0.05)[0]:
                self.conn.poll()
                while self.conn.notifies:
                    self.conn.notifies.pop()
                    self.count += 1

    def close(self):
        self.stop = True
        self.thread.join()
        self.cm.__exit__(None, None, None)


def test_busy_relay_is_not_notified_and_an_idle_one_is(db, servers, broker, queue,
                                                        relay_daemons):
    declare_consumer_queue(broker, queue, ["payment.failed"])
    relay = relay_daemons(args=["--poll-interval", "10s"], wait_ready=True)
    # quiet for a second: the relay says it is idle
    wait_until(lambda: idle_rows(db) == 1, 10, 0.05, "the relay's idle row")
    listener = Listener(db)
    try:
        # idle: one emit is notified, and the NOTIFY (not the 10 s poll) gets it out at once
        sub = new_id()
        t = time.time()
        eid = emit(db, "payment.failed", sub, f"w:{new_id()}", payload(subscription_id=sub))
        first = sent_at_latency(db, eid, t)
        assert first < 1.0, f"an idle relay took {first:.3f} s to publish a notified event"
        wait_until(lambda: listener.count == 1, 5, 0.02, "one NOTIFY for the first emit")
        # busy now: a steady stream of emits, one a transaction, is not notified (on one
        # connection, autocommit: a new connection per emit can take longer than the relay's
        # quiet time on a loaded machine, and then the relay is idle in between, rightly)
        ids = []
        with db.connect() as conn:
            for i in range(300):
                ids.append(emit(db, "payment.failed", sub, f"w:{new_id()}",
                                payload(subscription_id=sub, n=i), conn=conn))
                time.sleep(0.002)
        wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == 301, 20, 0.05,
                   "all 301 sent")
        notifies = listener.count - 1
        print(f"\nfirst event after idle: {first * 1000:.1f} ms; NOTIFYs for 300 emits while "
              f"busy: {notifies}")
        assert notifies <= 10, (f"{notifies} NOTIFYs for 300 emits to a busy relay: emitters "
                                f"still notify on every commit")
        # and it goes idle again once nothing comes
        wait_until(lambda: idle_rows(db) == 1, 10, 0.05, "the relay idle again")
    finally:
        listener.close()
    assert relay.proc.poll() is None


def test_missed_wake_up_costs_at_most_one_poll_interval(db, servers, broker, queue,
                                                        relay_daemons):
    """An emitter that called idem_emit while the relay was busy (so it will not notify) and
    commits after the relay went idle and looked one last time: the backstop poll finds it."""
    declare_consumer_queue(broker, queue, ["payment.failed"])
    relay_daemons(args=["--poll-interval", "1s"], wait_ready=True)
    wait_until(lambda: idle_rows(db) == 1, 10, 0.05, "the relay's idle row")
    worst = 0.0
    for k in range(3):
        sub = new_id()
        emit(db, "payment.failed", sub, f"m:{new_id()}", payload(subscription_id=sub))
        wait_until(lambda: idle_rows(db) == 0, 5, 0.002, "the relay busy")
        with db.connect(autocommit=False) as conn:
            eid = emit(db, "payment.failed", sub, f"m:{new_id()}",
                       payload(subscription_id=sub), conn=conn)
            wait_until(lambda: idle_rows(db) == 1, 10, 0.01, "the relay idle again")
            time.sleep(0.1)  # past its last look
            conn.commit()
            t = time.time()
        lat = sent_at_latency(db, eid, t)
        worst = max(worst, lat)
        print(f"\nmissed wake-up {k + 1}: published {lat * 1000:.0f} ms after the commit "
              f"(--poll-interval 1s)")
    # the commit came ~0.1 s after the relay went idle; its polls, the interval doubling from
    # 4 ms, find the row within about as long again: well inside the 1 s backstop
    assert worst <= 0.75, (f"a missed wake-up took {worst:.3f} s: the relay waited for its "
                           f"backstop poll instead of polling more often just after going idle")


def test_stale_idle_row_of_a_killed_relay_is_cleared(db, servers, broker, queue, relay_daemons):
    declare_consumer_queue(broker, queue, ["payment.failed"])
    first = relay_daemons(name="killed", wait_ready=True)
    wait_until(lambda: idle_rows(db) == 1, 10, 0.05, "the relay's idle row")
    first.proc.kill()
    first.proc.wait()
    # the killed relay's connection is gone (its row stays, only a hint)
    pid = db.scalar("SELECT pid FROM idem.idem_relay_idle")
    wait_until(lambda: db.count("pg_stat_activity", "pid = %s", pid) == 0, 10, 0.05,
               "the killed relay's connection gone")
    assert idle_rows(db) == 1
    # ... and wakes nobody: while no relay runs, emits do not NOTIFY (each NOTIFY would make
    # the emitters' commits wait for one another)
    listener = Listener(db)
    try:
        for _ in range(20):
            emit(db, "payment.failed", new_id(), f"stale:{new_id()}", payload())
        time.sleep(0.3)
        assert listener.count == 0, f"{listener.count} NOTIFYs for a relay that is gone"
    finally:
        listener.close()
    relay_daemons(name="next", wait_ready=True)
    wait_until(lambda: db.scalar("SELECT count(*) FROM idem.idem_relay_idle WHERE pid = %s",
                                 pid) == 0, 10, 0.05, "the stale idle row deleted")


def test_a_relay_that_stops_takes_its_idle_row_with_it(db, servers, broker, queue,
                                                       relay_daemons):
    declare_consumer_queue(broker, queue, ["payment.failed"])
    relay = relay_daemons(name="stopping", wait_ready=True)
    wait_until(lambda: idle_rows(db) == 1, 10, 0.05, "the relay's idle row")
    # the row names the relay's session: its pid and its application_name
    pid, app = db.query("SELECT pid, app FROM idem.idem_relay_idle")[0]
    assert db.scalar("SELECT application_name FROM pg_stat_activity WHERE pid = %s",
                     pid) == app, app
    assert app.startswith("idem relay pid "), app
    assert relay.stop() == 0
    # gone with the relay: a row left behind would name a pid another session may get
    assert idle_rows(db) == 0


def test_an_idle_row_whose_pid_another_session_has_wakes_nobody(db):
    """A relay stopped while idle left its row, and PostgreSQL gave its pid to another session
    (an application's): emits do not notify for it. The same row naming that session as it is
    (its own application_name) does: the look tells them apart."""
    with db.connect() as other:
        other.set_session(autocommit=True)
        with other.cursor() as cur:
            cur.execute("SET application_name = 'billing-app'")
            cur.execute("SELECT pg_backend_pid()")
            pid = cur.fetchone()[0]
        db.execute("INSERT INTO idem.idem_relay_idle (pid, app) VALUES (%s, %s)", pid,
                   "idem relay pid 4242")
        listener = Listener(db)
        try:
            for _ in range(10):
                emit(db, "payment.failed", new_id(), f"reused:{new_id()}", payload())
            time.sleep(0.3)
            assert listener.count == 0, f"{listener.count} NOTIFYs for a relay that is gone"
            db.execute("UPDATE idem.idem_relay_idle SET app = 'billing-app' WHERE pid = %s", pid)
            emit(db, "payment.failed", new_id(), f"named:{new_id()}", payload())
            wait_until(lambda: listener.count >= 1, 5, 0.02, "a NOTIFY for the named session")
        finally:
            listener.close()


def test_an_idle_row_not_written_for_30_seconds_wakes_nobody(db):
    """Where every session has one application_name, a row left by a relay killed while idle
    names, once its pid comes round, a live session of that name: it counts for 30 s after it
    was written, no longer. The same row written now does count."""
    with db.connect() as other:
        other.set_session(autocommit=True)
        with other.cursor() as cur:
            cur.execute("SET application_name = 'billing-app'")
            cur.execute("SELECT pg_backend_pid()")
            pid = cur.fetchone()[0]
        db.execute("INSERT INTO idem.idem_relay_idle (pid, app, since)"
                   " VALUES (%s, 'billing-app', now() - interval '31 seconds')", pid)
        listener = Listener(db)
        try:
            for _ in range(10):
                emit(db, "payment.failed", new_id(), f"aged:{new_id()}", payload())
            time.sleep(0.3)
            assert listener.count == 0, f"{listener.count} NOTIFYs for a row 31 s old"
            db.execute("UPDATE idem.idem_relay_idle SET since = now() WHERE pid = %s", pid)
            emit(db, "payment.failed", new_id(), f"fresh:{new_id()}", payload())
            wait_until(lambda: listener.count >= 1, 5, 0.02, "a NOTIFY for the row written now")
        finally:
            listener.close()
            db.execute("DELETE FROM idem.idem_relay_idle WHERE pid = %s", pid)


def test_a_relay_idle_for_long_keeps_its_row_counted(db, servers, broker, queue, relay_daemons):
    """An idle relay writes its row again every 10 s, so an emit long after the relay went idle
    still notifies it, and the NOTIFY (not the 10 s poll) gets the event out."""
    declare_consumer_queue(broker, queue, ["payment.failed"])
    relay_daemons(args=["--poll-interval", "10s"], wait_ready=True)
    wait_until(lambda: idle_rows(db) == 1, 10, 0.05, "the relay's idle row")
    first = db.scalar("SELECT since FROM idem.idem_relay_idle")
    wait_until(lambda: db.scalar("SELECT since FROM idem.idem_relay_idle") > first, 15, 0.2,
               "the idle row written again")
    again = db.scalar("SELECT since FROM idem.idem_relay_idle")
    gap = (again - first).total_seconds()
    assert 9.0 <= gap <= 12.0, f"written again after {gap:.1f} s (every 10 s expected)"
    listener = Listener(db)
    try:
        sub = new_id()
        t = time.time()
        eid = emit(db, "payment.failed", sub, f"late:{new_id()}", payload(subscription_id=sub))
        took = sent_at_latency(db, eid, t)
        wait_until(lambda: listener.count == 1, 5, 0.02, "a NOTIFY for the idle relay")
        assert took < 1.0, f"a relay idle for {gap:.0f} s took {took:.3f} s to publish"
    finally:
        listener.close()
