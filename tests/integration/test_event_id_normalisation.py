"""The event id is read from message_id, else the event_id header, in any form PostgreSQL's uuid
accepts, and normalised to lowercase canonical form before the claim; the event type is read from
the type property, else the event_type header, else the routing key."""

import json
import time

import pytest

from conftest import new_id, payload

CANON = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
FORMS = [
    "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
    "{A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11}",
    "a0eebc999c0b4ef8bb6d6bb9bd380a11",
    "{a0eebc99-9c0b4ef8-bb6d6bb9-bd380a11}",
]


@pytest.mark.parametrize("other", FORMS)
def test_other_forms_dedup_against_canonical(db, queue, consumers, broker, other):
    c = consumers("billing", queue, db)
    body = payload()
    broker.publish_event("payment.failed", body, event_id=other)
    broker.publish_event("payment.failed", body, event_id=CANON)
    broker.publish_event("payment.failed", body, event_id=other.lower())
    c.wait_handled(3)
    assert c.metric("idem_consumer_applied_total") == 1
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", CANON)]
    # The ledger column is uuid; its text is the canonical form.
    assert db.scalar("SELECT event_id::text FROM idem.consumed_events") == CANON


def test_event_id_header_when_no_message_id(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db)
    body = payload()
    eid = new_id()
    broker.publish_raw(json.dumps(body), routing_key="payment.failed", type="payment.failed",
                       message_id=None, headers={"event_id": eid.upper()},
                       timestamp=int(time.time()))
    c.wait_handled(1)
    # The same event again, now with message_id: a duplicate.
    broker.publish_event("payment.failed", body, event_id=eid)
    c.wait_handled(2)
    assert c.metric("idem_consumer_duplicates_total") == 1
    assert c.stop() == 0
    assert db.ledger() == [("billing", eid)]
    assert db.dunning_step(body["subscription_id"]) == 1
    assert dead_letters(queue).poll() == []


def test_message_id_wins_over_event_id_header(db, queue, consumers, broker):
    c = consumers("billing", queue, db)
    mid, hid = new_id(), new_id()
    broker.publish_event("payment.failed", payload(), event_id=mid, headers={"event_id": hid})
    c.wait_handled(1)
    assert c.stop() == 0
    assert db.ledger() == [("billing", mid)]


def test_type_from_event_type_header_then_routing_key(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db, args=["--bind", "payment.failed", "--bind", "invoice.paid"])
    now = int(time.time())
    # No type property: the event_type header names it (the routing key, the queue's name when
    # published straight to the queue, is not a known type).
    p1 = payload()
    e1 = new_id()
    broker.to_queue(queue, json.dumps(p1), message_id=e1, type=None,
                    headers={"event_type": "payment.failed"}, timestamp=now)
    # Neither type nor header: the routing key.
    p2 = payload()
    e2 = new_id()
    broker.publish_raw(json.dumps(p2), routing_key="invoice.paid", message_id=e2, type=None,
                       timestamp=now)
    # The type property wins over the header.
    p3 = payload()
    e3 = new_id()
    broker.publish_raw(json.dumps(p3), routing_key="payment.failed", message_id=e3,
                       type="payment.failed", headers={"event_type": "invoice.paid"}, timestamp=now)
    c.wait_handled(3)
    assert c.stop() == 0
    assert db.dunning_step(p1["subscription_id"]) == 1
    assert db.query("SELECT invoice_id::text FROM billing.revenue_entries") == [(p2["invoice_id"],)]
    assert db.dunning_step(p3["subscription_id"]) == 1
    assert db.count("billing.revenue_entries", "invoice_id = %s", p3["invoice_id"]) == 0
    assert db.ledger() == sorted(("billing", e) for e in (e1, e2, e3))
    assert dead_letters(queue).poll() == []
