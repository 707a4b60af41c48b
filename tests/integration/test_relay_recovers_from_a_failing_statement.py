"""The relay never stays inside an aborted transaction (contract, "Failure policy (relay)": a
failing claim, mark or commit statement rolls back and is retried with backoff).

A claim that fails (cancelled by an operator, a lock timeout, a terminated backend) leaves its
connection in an aborted transaction. Without the rollback every later statement on that
connection fails with 25P02 ("current transaction is aborted"): the relay stops publishing for
good while it looks alive, or it publishes and never manages to mark the rows sent, so the same
rows go out again and again (a duplicate storm). Each test breaks the claim one way, then emits
30 events: all must be sent within 10 s, each reaching the queue exactly once, and no backend of
the relay may be left idle in an aborted transaction.
"""

import json
import time

from conftest import new_id, payload, wait_until
from relay_helpers import (declare_consumer_queue, emit_many, read_queue, relay_daemons,
                           status_counts)

__all__ = ["relay_daemons"]

TYPE = "payment.failed"
N = 30


def relay_backends(db, where="true"):
    """[(pid, state, wait_event_type, wait_event, query)] of the relay's backends (application_name
    'idem relay pid N') in this test's database."""
    return db.query(
        "SELECT pid, state, wait_event_type, wait_event, left(query, 80) FROM pg_stat_activity"
        " WHERE application_name LIKE 'idem relay pid %%' AND datname = current_database()"
        " AND pid <> pg_backend_pid() AND " + where)


def waiting_on_lock(db):
    return [r[0] for r in relay_backends(db, "wait_event_type = 'Lock'")]


class TableLock:
    """Holds LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE on a connection of its own until
    release() (which commits whatever else that transaction did)."""

    def __init__(self, db):
        self.ctx = db.connect(autocommit=False)
        self.conn = self.ctx.__enter__()
        with self.conn.cursor() as cur:
            cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")

    def release(self):
        if self.conn is not None:
            self.conn.commit()
            self.ctx.__exit__(None, None, None)
            self.conn = None


def emit_batch(db, tag, n=N):
    subs = [new_id() for _ in range(5)]
    return emit_many(db, [(TYPE, subs[i % 5], f"{tag}:{i}:{new_id()}",
                           payload(subscription_id=subs[i % 5], n=i)) for i in range(n)],
                     per_tx=5)


def assert_sent_once(db, broker, queue, ids, timeout=10):
    """All of ids are sent within timeout seconds; the queue got each exactly once."""
    t0 = time.monotonic()
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent' AND event_id = ANY(%s::uuid[])",
                                ids) == len(ids), timeout, 0.1,
               lambda: f"{len(ids)} rows sent within {timeout}s (now {status_counts(db)})")
    took = time.monotonic() - t0
    got = [m.event_id for m in read_queue(broker, queue, expect=len(ids), timeout=10, idle=1.0)]
    dups = sorted({i for i in got if got.count(i) > 1})
    assert sorted(set(got)) == sorted(ids), "every event reached the queue"
    assert not dups, f"{len(got)} messages for {len(ids)} events; duplicated: {dups[:5]}"
    assert db.count("idem.event_outbox", "attempts > 0") == 0, "a failing statement spends nothing"
    return took


def assert_no_aborted_transaction(db, relay):
    rows = relay_backends(db)
    assert rows, "the relay has backends"
    bad = [r for r in rows if r[1] == "idle in transaction (aborted)"]
    assert not bad, f"relay backends left in an aborted transaction: {bad}\n{relay.log()[-3000:]}"
    assert relay.running(), relay.log()[-3000:]


def test_cancelled_claim_rolls_back_and_relay_carries_on(db, servers, queue, broker,
                                                         relay_daemons):
    """(a) pg_cancel_backend of the claim while it waits for a lock (57014)."""
    declare_consumer_queue(broker, queue, [TYPE])
    relay = relay_daemons(["--lock-timeout", "30s"], wait_ready=True)

    lock = TableLock(db)
    try:
        pids = wait_until(lambda: waiting_on_lock(db), 10, 0.05,
                          lambda: f"a relay backend waiting on the table lock "
                                  f"(backends: {relay_backends(db)})")
        cancelled = db.query("SELECT pid, pg_cancel_backend(pid) FROM unnest(%s::int[]) AS pid",
                             pids)
        assert all(ok for _, ok in cancelled), cancelled
        wait_until(lambda: "canceling statement due to user request" in relay.log(), 10, 0.05,
                   "the relay to see its claim cancelled")
    finally:
        lock.release()

    ids = emit_batch(db, "after-cancel")
    took = assert_sent_once(db, broker, queue, ids)
    log = relay.log()
    assert "rolled back" in log, log[-3000:]
    assert "current transaction is aborted" not in log, (
        "a statement ran inside the aborted transaction:\n" + log[-3000:])
    assert_no_aborted_transaction(db, relay)
    print(f"{N} rows sent {took:.1f}s after the cancel")


def test_lock_timeout_rolls_back_retries_then_sends(db, servers, queue, broker, relay_daemons):
    """(b) --lock-timeout 1s with the table locked ~3 s: each claim fails with 55P03, rolls back,
    is retried with backoff; the 30 rows committed with the lock are all sent once it is
    released."""
    declare_consumer_queue(broker, queue, [TYPE])
    relay = relay_daemons(["--lock-timeout", "1s"], wait_ready=True)

    lock = TableLock(db)
    try:
        # The events are emitted in the locking transaction: they become visible when the lock is
        # released, so every claim made meanwhile must fail on the lock, not find nothing.
        subs = [new_id() for _ in range(5)]
        ids = []
        with lock.conn.cursor() as cur:
            for i in range(N):
                s = subs[i % 5]
                cur.execute("SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb)::text",
                            (TYPE, s, f"locked:{i}:{new_id()}",
                             json.dumps(payload(subscription_id=s, n=i))))
                ids.append(cur.fetchone()[0])
        t_lock = time.monotonic()
        wait_until(lambda: relay.log().count("canceling statement due to lock timeout") >= 2, 10,
                   0.05, lambda: "two claims failing on the lock timeout:\n" + relay.log()[-2000:])
        # the relay is still up and tries again (not stuck in a dead transaction)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t_lock)))
        assert relay.running(), relay.log()[-3000:]
    finally:
        lock.release()

    assert_sent_once(db, broker, queue, ids)
    log = relay.log()
    assert "rolled back" in log, log[-3000:]
    assert "current transaction is aborted" not in log, log[-3000:]
    assert_no_aborted_transaction(db, relay)


def test_terminated_backends_reconnect_and_carry_on(db, servers, queue, broker, relay_daemons):
    """(c) pg_terminate_backend of the relay's backends, idle and then in the middle of a claim:
    it reconnects and carries on, nothing lost, nothing twice."""
    declare_consumer_queue(broker, queue, [TYPE])
    relay = relay_daemons(["--lock-timeout", "30s"], wait_ready=True)

    before = {r[0] for r in relay_backends(db)}
    assert len(before) >= 2, relay_backends(db)
    killed = db.query("SELECT pid, pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                      sorted(before))
    assert all(ok for _, ok in killed), killed
    first = emit_batch(db, "after-idle-kill", n=10)
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == 10, 10, 0.1,
               lambda: f"10 rows sent after the idle backends were terminated "
                       f"(now {status_counts(db)})\n{relay.log()[-2000:]}")

    # Now terminate the backend in the middle of a claim (waiting for the table lock).
    lock = TableLock(db)
    try:
        pids = wait_until(lambda: waiting_on_lock(db), 10, 0.05, "a claim waiting on the lock")
        db.query("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", pids)
        wait_until(lambda: not set(pids) & {r[0] for r in relay_backends(db)}, 10, 0.05,
                   "the terminated backend gone")
    finally:
        lock.release()
    second = emit_batch(db, "after-claim-kill", n=N - 10)

    assert_sent_once(db, broker, queue, first + second)
    after = {r[0] for r in relay_backends(db)}
    assert after and not after & before, (before, after)
    assert_no_aborted_transaction(db, relay)


def test_failed_claim_does_not_discard_a_confirmed_batch(db, servers, queue, broker,
                                                         relay_daemons):
    """(c, pinned down) Every relay backend but the oldest is terminated while idle, then 10
    events are emitted. The relay claims and publishes them on its healthy connection; the broker
    confirms them; its next claim, on a dead connection, fails. That failure belongs to the other
    transaction: the confirmed batch must still be marked sent, not rolled back and published a
    second time."""
    declare_consumer_queue(broker, queue, [TYPE])
    relay = relay_daemons(wait_ready=True)
    pids = [r[0] for r in db.query(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'idem relay pid %%'"
        " AND datname = current_database() ORDER BY backend_start, pid")]
    assert len(pids) >= 2, pids
    db.query("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", pids[1:])
    wait_until(lambda: not set(pids[1:]) & {r[0] for r in relay_backends(db)}, 10, 0.05,
               "the terminated backends gone")
    ids = emit_batch(db, "one-healthy-slot", n=10)
    assert_sent_once(db, broker, queue, ids)
    assert_no_aborted_transaction(db, relay)


def test_table_lock_while_busy_sends_each_once(db, servers, queues, broker, relay_daemons):
    """(b, under load) The table is locked (as a migration's ALTER TABLE would) while the relay is
    draining a backlog with --lock-timeout 1s. The relay's next claim waits behind the lock
    request, which waits for the relay's own open batch: the lock timeout breaks that, and only
    the claim that failed may be rolled back. The batch in flight was confirmed by the broker; it
    must still be marked sent, or its rows are published a second time."""
    q = queues.new()
    with broker.channel() as ch:
        broker.declare_exchange(ch)
        ch.queue_declare(queue=q, durable=False)
        ch.queue_bind(queue=q, exchange="billing.events", routing_key=TYPE)
    n = 20_000
    db.execute("INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload)"
               " SELECT gen_random_uuid(), gen_random_uuid(), %s, jsonb_build_object('n', i)"
               " FROM generate_series(1, %s) AS i", TYPE, n)
    relay = relay_daemons(["--lock-timeout", "1s", "--batch", "50"])
    wait_until(lambda: relay.sent() > 0, 15, 0.01, "the relay publishing")

    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SET lock_timeout = '20s'")
        cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
        held_at = relay.sent()
        time.sleep(1.5)
        conn.commit()
    assert held_at < n, "the backlog was drained before the lock was taken"

    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == n, 20, 0.2,
               lambda: f"{n} rows sent (now {status_counts(db)})")
    wait_until(lambda: broker.depth(q) >= n, 10, 0.2, "every message in the queue")
    time.sleep(0.5)  # anything published twice arrives too
    depth = broker.queue_info(q)[0]
    assert "lock timeout" in relay.log(), "the lock did not make a claim fail"
    assert depth == n, (f"{depth} messages for {n} events: {depth - n} published twice\n"
                        + "\n".join(line for line in relay.log().splitlines()
                                    if "rolled back" in line or "warn" in line)[-3000:])
    assert_no_aborted_transaction(db, relay)
