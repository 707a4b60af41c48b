"""The same event delivered several times is applied once: one ledger row, one effect."""

from conftest import new_id, payload


def test_three_deliveries_together_advance_dunning_once(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db)
    body = payload()
    eid = new_id()
    for _ in range(3):  # back to back: they may well land in one batch
        broker.publish_event("payment.failed", body, event_id=eid)

    c.wait_handled(3)
    assert c.metric("idem_consumer_applied_total") == 1
    assert c.metric("idem_consumer_duplicates_total") == 2
    assert c.stop() == 0

    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


def test_redelivery_after_apply_is_a_duplicate(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db)
    body = payload()
    eid = new_id()
    broker.publish_event("payment.failed", body, event_id=eid)
    c.wait_handled(1)
    assert db.dunning_step(body["subscription_id"]) == 1

    # Two later deliveries under the same id: the same event again is a duplicate; another body
    # is an id collision, dead-lettered as conflict and never applied.
    broker.publish_event("payment.failed", body, event_id=eid)
    broker.publish_event("payment.failed", dict(body, amount_cents=99), event_id=eid)
    c.wait_handled(2)
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="conflict")
    assert c.metric("idem_consumer_duplicates_total") == 1
    assert c.stop() == 0

    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    assert broker.depth(queue) == 0
    assert [m.error.split(":")[0] for m in dead_letters(queue).wait(1)] == ["conflict"]


def test_distinct_events_each_applied(db, queue, consumers, broker):
    """Control for the above: different event ids for one subscription are all applied."""
    c = consumers("billing", queue, db)
    sub = new_id()
    ids = [broker.publish_event("payment.failed", payload(subscription_id=sub)) for _ in range(3)]
    c.wait_handled(3)
    assert c.stop() == 0
    assert db.dunning_step(sub) == 3
    assert db.ledger() == sorted(("billing", i) for i in ids)
