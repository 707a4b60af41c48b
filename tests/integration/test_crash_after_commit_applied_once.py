"""A consumer killed after COMMIT but before the ack: the broker redelivers the message to the
restarted consumer, which finds the claim and acks without applying the event again."""

import signal

from conftest import new_id, payload, wait_until


def test_crash_after_commit_redelivered_applied_once(db, queue, consumers, broker, dead_letters):
    c1 = consumers("billing", queue, db, fault="consumer.after_commit")
    body = payload()
    eid = new_id()
    broker.publish_event("payment.failed", body, event_id=eid)

    assert c1.wait_exit(15) == -signal.SIGKILL
    # Committed: the effect and the claim are there, but the message was never acked.
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    wait_until(lambda: broker.queue_info(queue) == (1, 0), 10, 0.1,
               "the unacked message back in the queue with no consumer")

    c2 = consumers("billing", queue, db)
    c2.wait_metric("idem_consumer_duplicates_total", 1)
    assert c2.metric("idem_consumer_applied_total") == 0
    assert c2.stop() == 0

    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


def test_crash_after_commit_of_second_batch(db, queue, consumers, broker):
    """IDEM_FAULT=POINT:N: the first transaction is acked normally, the second one crashes."""
    c1 = consumers("billing", queue, db, fault="consumer.after_commit:2")
    sub = new_id()
    e1 = broker.publish_event("payment.failed", payload(subscription_id=sub))
    c1.wait_handled(1)
    e2 = broker.publish_event("payment.failed", payload(subscription_id=sub))
    assert c1.wait_exit(15) == -signal.SIGKILL
    assert db.dunning_step(sub) == 2

    c2 = consumers("billing", queue, db)
    c2.wait_metric("idem_consumer_duplicates_total", 1)
    assert c2.stop() == 0
    assert db.dunning_step(sub) == 2
    assert db.ledger() == sorted([("billing", e1), ("billing", e2)])
    assert broker.depth(queue) == 0
