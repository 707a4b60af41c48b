"""End to end: emit -> `idem relay` -> RabbitMQ -> `idem consume` -> effects, each once, including
invoice.paid's follow-up receipt.requested (emitted through the outbox in the consumer's
transaction, relayed, consumed). Also the wire format of a relayed message."""

import json

from conftest import new_id, payload, wait_until
from relay_helpers import (declare_consumer_queue, emit, md5_uuid, outbox, read_queue,
                           relay_daemons, status_counts)

__all__ = ["relay_daemons"]


def test_emit_relay_consume_effects_once(db, servers, queue, broker, consumers, relay_daemons,
                                         dead_letters):
    c = consumers("billing", queue, db)  # declares and binds its queue to the handled types
    relay = relay_daemons(name="relay", wait_ready=True)
    sub_a, sub_b = new_id(), new_id()
    inv = new_id()

    # Phase 1: three payment failures (distinct keys): A twice, B once; one replayed emit.
    pf = [emit(db, "payment.failed", sub_a, f"pf:{sub_a}:1", payload(subscription_id=sub_a)),
          emit(db, "payment.failed", sub_a, f"pf:{sub_a}:2", payload(subscription_id=sub_a)),
          emit(db, "payment.failed", sub_b, f"pf:{sub_b}:1", payload(subscription_id=sub_b))]
    assert emit(db, "payment.failed", sub_a, f"pf:{sub_a}:1",
                payload(subscription_id=sub_a)) == pf[0], "a replayed emit returns the same id"
    wait_until(lambda: db.dunning_step(sub_a) == 2 and db.dunning_step(sub_b) == 1, 15, 0.1,
               lambda: f"dunning A=2, B=1 (now A={db.dunning_step(sub_a)}, "
                       f"B={db.dunning_step(sub_b)}; outbox {status_counts(db)})")

    # Phase 2: B's invoice is paid (resets B's dunning, books revenue, requests a receipt);
    # the business operation is replayed once.
    body = payload(subscription_id=sub_b, invoice_id=inv, amount_cents=4200, currency="EUR")
    ip = emit(db, "invoice.paid", sub_b, f"invoice:{inv}:paid", body)
    assert emit(db, "invoice.paid", sub_b, f"invoice:{inv}:paid", body) == ip
    receipt_id = md5_uuid(f"idem:{ip}:receipt")  # its follow-up's key
    wait_until(lambda: db.count("billing.receipts") >= 1, 20, 0.1,
               lambda: f"the receipt (outbox {status_counts(db)}, ledger {db.ledger()})")
    all_ids = pf + [ip, receipt_id]
    wait_until(lambda: len(db.ledger()) >= len(all_ids), 10, 0.1, "every event in the ledger")
    c.wait_handled(len(all_ids))
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == len(all_ids), 10, 0.1,
               lambda: f"every outbox row sent (now {status_counts(db)})")

    # Effects, each once.
    assert db.dunning_step(sub_a) == 2
    assert db.dunning_step(sub_b) == 0, "invoice.paid resets the subscription's dunning"
    assert db.query("SELECT invoice_id::text, subscription_id::text, amount_cents, currency,"
                    " event_id::text FROM billing.revenue_entries") == [(inv, sub_b, 4200, "EUR", ip)]
    assert db.query("SELECT invoice_id::text, subscription_id::text, event_id::text"
                    " FROM billing.receipts") == [(inv, sub_b, receipt_id)]

    # The follow-up went through the outbox with the derived id, and was relayed.
    rows = outbox(db)
    assert sorted(rows) == sorted(all_ids), "one outbox row per event, replays collapsed"
    assert rows[receipt_id]["event_type"] == "receipt.requested"
    assert rows[receipt_id]["subscription_id"] == sub_b
    assert db.scalar("SELECT md5('idem:' || %s || ':receipt')::uuid::text", ip) == receipt_id
    assert db.scalar("SELECT payload FROM idem.event_outbox WHERE event_id = %s", receipt_id) == body
    assert {(v["status"], v["attempts"]) for v in rows.values()} == {("sent", 0)}

    # The ledger: every event once.
    assert db.ledger() == sorted(("billing", i) for i in all_ids)
    assert c.metric("idem_consumer_applied_total") == len(all_ids)
    assert c.metric("idem_consumer_duplicates_total") == 0
    assert c.stop() == 0
    assert relay.stop() == 0
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


def test_wire_format(db, servers, queues, broker, relay_daemons):
    q = queues.new("wire")
    declare_consumer_queue(broker, q, ["invoice.paid"])
    sub, inv = new_id(), new_id()
    body = payload(subscription_id=sub, invoice_id=inv, amount_cents=999, currency="GBP",
                   note="caf\u00e9 \"quoted\"")
    eid = emit(db, "invoice.paid", sub, f"invoice:{inv}:paid", body)
    relay = relay_daemons(name="relay")
    wait_until(lambda: outbox(db)[eid]["status"] == "sent", 15, 0.05, "the row sent")
    assert relay.stop() == 0

    [m] = read_queue(broker, q, expect=1)
    p = m.props
    assert m.method.routing_key == "invoice.paid"
    assert m.method.exchange == "billing.events"
    assert p.message_id == eid
    assert p.type == "invoice.paid"
    assert p.content_type == "application/json"
    assert p.delivery_mode == 2
    created = db.scalar("SELECT extract(epoch FROM created_at) FROM idem.event_outbox"
                        " WHERE event_id = %s", eid)
    assert isinstance(p.timestamp, int) and abs(p.timestamp - float(created)) < 1, (
        p.timestamp, created)
    raw = (p.headers or {})
    for k in ("event_id", "subscription_id", "event_type"):
        assert isinstance(raw.get(k), (str, bytes)), f"header {k} must be a string: {raw!r}"
    assert m.headers["event_id"] == eid
    assert m.headers["subscription_id"] == sub
    assert m.headers["event_type"] == "invoice.paid"
    assert json.loads(m.raw.decode("utf-8")) == body
