"""Two consumers (different --consumer names, each with its own queue bound to the exchange)
sharing one database each apply an event once: the ledger is keyed by (consumer, event_id)."""

from conftest import new_id, payload


def test_each_consumer_applies_the_event_once(db, queues, consumers, broker, dead_letters):
    qa, qb = queues.new("a"), queues.new("b")
    a = consumers("dunning-a", qa, db)
    b = consumers("dunning-b", qb, db)

    body = payload()
    eid = new_id()
    broker.publish_event("payment.failed", body, event_id=eid)
    a.wait_handled(1)
    b.wait_handled(1)
    # Both run the same bundled handler, so each bumps the step: one step per consumer.
    assert db.dunning_step(body["subscription_id"]) == 2

    # A redelivery reaches both queues again: a duplicate for each, no further effect.
    broker.publish_event("payment.failed", body, event_id=eid)
    a.wait_handled(2)
    b.wait_handled(2)
    for c in (a, b):
        assert c.metric("idem_consumer_applied_total") == 1
        assert c.metric("idem_consumer_duplicates_total") == 1
        assert c.stop() == 0

    assert db.dunning_step(body["subscription_id"]) == 2
    assert db.ledger() == [("dunning-a", eid), ("dunning-b", eid)]
    assert db.ledger("dunning-a") == [("dunning-a", eid)]
    assert db.ledger("dunning-b") == [("dunning-b", eid)]
    for q in (qa, qb):
        assert broker.depth(q) == 0
        assert dead_letters(q).poll() == []


def test_invoice_paid_recognised_once_per_consumer(db, queues, consumers, broker):
    qa, qb = queues.new("a"), queues.new("b")
    a = consumers("revenue-a", qa, db, args=["--bind", "invoice.paid"])
    b = consumers("revenue-b", qb, db, args=["--bind", "invoice.paid"])
    body = payload(amount_cents=4200)
    eid = new_id()
    for _ in range(2):
        broker.publish_event("invoice.paid", body, event_id=eid)
    a.wait_handled(2)
    b.wait_handled(2)
    assert a.stop() == 0 and b.stop() == 0

    assert db.count("billing.revenue_entries", "invoice_id = %s", body["invoice_id"]) == 2
    assert db.query("SELECT DISTINCT event_id::text, amount_cents, currency FROM billing.revenue_entries") == [
        (eid, 4200, "USD")]
    assert db.ledger() == [("revenue-a", eid), ("revenue-b", eid)]
    # Both emitted the follow-up with the same dedup key: one outbox row.
    assert db.count("idem.event_outbox", "event_type = 'receipt.requested'") == 1
