"""A consumer killed before COMMIT leaves neither the effect nor the claim; the redelivered
message is applied once by the restarted consumer."""

import signal

from conftest import new_id, payload, wait_until


def test_crash_before_commit_leaves_nothing_then_applied_once(db, queue, consumers, broker,
                                                               dead_letters):
    c1 = consumers("billing", queue, db, fault="consumer.before_commit")
    body = payload()
    eid = new_id()
    broker.publish_event("payment.failed", body, event_id=eid)
    assert c1.wait_exit(15) == -signal.SIGKILL

    # While it is dead: no effect, no claim, the message is waiting in the queue.
    assert db.dunning_step(body["subscription_id"]) is None
    assert db.count("billing.dunning") == 0
    assert db.ledger() == []
    wait_until(lambda: broker.queue_info(queue) == (1, 0), 10, 0.1,
               "the unacked message back in the queue with no consumer")

    c2 = consumers("billing", queue, db)
    c2.wait_metric("idem_consumer_applied_total", 1)
    assert c2.metric("idem_consumer_duplicates_total") == 0
    assert c2.stop() == 0

    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


def test_crash_before_commit_of_invoice_paid_leaves_no_follow_up(db, queue, consumers, broker):
    """The follow-up receipt.requested is emitted in the handler's transaction: a crash before
    COMMIT must not leave it in the outbox, and the retry emits it exactly once."""
    c1 = consumers("revenue", queue, db, args=["--bind", "invoice.paid"],
                   fault="consumer.before_commit")
    body = payload()
    eid = broker.publish_event("invoice.paid", body)
    assert c1.wait_exit(15) == -signal.SIGKILL
    assert db.count("billing.revenue_entries") == 0
    assert db.count("idem.event_outbox") == 0
    assert db.ledger() == []

    c2 = consumers("revenue", queue, db, args=["--bind", "invoice.paid"])
    c2.wait_metric("idem_consumer_applied_total", 1)
    assert c2.stop() == 0
    assert db.query("SELECT invoice_id::text, event_id::text FROM billing.revenue_entries") == [
        (body["invoice_id"], eid)]
    assert db.query("SELECT event_type, subscription_id::text, status FROM idem.event_outbox") == [
        ("receipt.requested", body["subscription_id"], "pending")]
    assert db.ledger() == [("revenue", eid)]
