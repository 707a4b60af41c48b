"""SIGTERM is honoured whatever the consumer is doing: paused by database trouble, or waiting
behind a lock (bounded by --lock-timeout), it exits 0 within a few seconds."""

import signal
import time

from conftest import new_id, payload, wait_until
from test_failing_handler_retried_then_dead_lettered import inject_failure


def test_sigterm_while_paused(db, queue, consumers, broker):
    inject_failure(db, "billing.dunning", "25006")
    c = consumers("billing", queue, db)
    for _ in range(5):
        broker.publish_event("payment.failed", payload())
    c.wait_metric("idem_consumer_paused_total", 3, timeout=20, sqlstate="25006")
    t0 = time.monotonic()
    c.signal(signal.SIGTERM)
    assert c.wait_exit(10) == 0
    assert time.monotonic() - t0 < 3


def test_sigterm_while_waiting_behind_a_lock(db, queue, consumers, broker):
    sub = new_id()
    db.execute("INSERT INTO billing.dunning (subscription_id, step) VALUES (%s, 1)", sub)
    c = consumers("billing", queue, db, args=["--lock-timeout", "3s"])
    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM billing.dunning WHERE subscription_id = %s FOR UPDATE", (sub,))
        broker.publish_event("payment.failed", payload(subscription_id=sub))
        wait_until(lambda: db.scalar("SELECT count(*) FROM pg_stat_activity WHERE "
                                     "application_name LIKE 'idem consumer pid %%' AND wait_event_type = 'Lock'"),
                   10, 0.05, "the consumer waiting on the lock")
        t0 = time.monotonic()
        c.signal(signal.SIGTERM)
        assert c.wait_exit(10) == 0
        assert time.monotonic() - t0 < 5
        conn.rollback()


def test_sigterm_while_a_batch_times_out_behind_a_lock(db, queue, consumers, broker):
    """A whole batch blocked by an application's lock on event_outbox (invoice.paid emits into
    it): the batch and then one delivery time out, and the rest are not tried one by one, each
    waiting out its own lock timeout; SIGTERM is honoured within seconds."""
    assert consumers("billing", queue, db).stop() == 0  # declares and binds the queue
    c = consumers("billing", queue, db, args=["--lock-timeout", "1s"], start=False)
    for _ in range(30):
        broker.publish_event("invoice.paid", payload())
    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
        c.start()
        wait_until(lambda: c.metric("idem_consumer_handler_errors_total") >= 1, 15, 0.1,
                   "a try failed on the lock")
        t0 = time.monotonic()
        c.signal(signal.SIGTERM)
        assert c.wait_exit(15) == 0
        took = time.monotonic() - t0
        conn.rollback()
    assert took < 4, f"SIGTERM took {took:.1f} s"
    assert db.ledger() == []
