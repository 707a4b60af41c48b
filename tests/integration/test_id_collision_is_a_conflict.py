"""An event id collision is never a silent drop: the ledger keeps a digest of what was applied
(event type, subscription_id, payload), and a delivery whose id is in the ledger with another
digest is dead-lettered `conflict` (error log line, dead_lettered_total{code="conflict"}) instead
of being taken for a duplicate. The same content again stays a duplicate; ledger rows written
before the digest existed (digest NULL) count as duplicates.

Without a --trusted-publisher list, a forged receipt.requested with the id of a future real
receipt is applied; the real one, relayed later, must then show up in QUEUE.dlq as a conflict.
"""

import json
import threading
import time

from conftest import new_id, payload, wait_until
from consumer_helpers import log_lines
from relay_helpers import emit, md5_uuid, relay_daemons

__all__ = ["relay_daemons"]


def conflicts(dl):
    return [m for m in dl if (m.error or "").startswith("conflict: ")]


def test_real_event_after_a_forgery_is_a_conflict_not_a_duplicate(
        db, servers, queue, broker, consumers, relay_daemons, dead_letters):
    c = consumers("billing", queue, db)  # no --trusted-publisher
    real_sub, evil_sub, inv = new_id(), new_id(), new_id()
    receipt_id = md5_uuid("idem:" + md5_uuid(f"invoice:{inv}:paid") + ":receipt")

    # the forgery is applied: nothing tells it apart without a trusted-publisher list
    evil = payload(subscription_id=evil_sub, invoice_id=inv, amount_cents=1)
    broker.publish_event("receipt.requested", evil, event_id=receipt_id)
    c.wait_metric("idem_consumer_applied_total", 1)
    assert db.query("SELECT subscription_id::text FROM billing.receipts") == [(evil_sub,)]

    # the real invoice is paid; its follow-up receipt has the same id and another content
    relay_daemons(name="relay", wait_ready=True)
    body = payload(subscription_id=real_sub, invoice_id=inv, amount_cents=4200)
    emit(db, "invoice.paid", real_sub, f"invoice:{inv}:paid", body)
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="conflict", timeout=20)
    dl = dead_letters(queue).wait(1)
    assert len(dl) == 1
    m = dl[0]
    assert m.props.message_id == receipt_id
    assert m.error.startswith("conflict: "), m.error
    assert json.loads(m.body) == body, "the dead letter is the real event, kept whole"
    assert m.header("subscription_id") == real_sub
    assert log_lines(c, rf" error +consumer: .*conflict.*event_id={receipt_id}"), c.log()[-3000:]
    assert c.metric("idem_consumer_duplicates_total") == 0
    assert db.count("billing.receipts") == 1  # nothing of the real one applied: it waits in the DLQ

    # the forgery's own body again is a plain duplicate, not a conflict
    broker.publish_event("receipt.requested", evil, event_id=receipt_id)
    c.wait_metric("idem_consumer_duplicates_total", 1)
    assert c.metric("idem_consumer_dead_lettered_total", code="conflict") == 1
    assert c.metric("idem_consumer_dead_lettered_total") == 1


def test_same_content_other_form_is_a_duplicate(db, queue, broker, consumers, dead_letters):
    """The digest is of the content, not of the bytes: key order and spacing do not matter, a
    different value does."""
    c = consumers("billing", queue, db)
    sub = new_id()
    eid = new_id()
    body = payload(subscription_id=sub)
    broker.publish_event("payment.failed", json.dumps(body), event_id=eid)
    c.wait_metric("idem_consumer_applied_total", 1)
    reordered = json.dumps(dict(reversed(list(body.items()))), indent=2)
    broker.publish_event("payment.failed", reordered, event_id=eid)
    c.wait_metric("idem_consumer_duplicates_total", 1)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    # the same payload under another event type is another event
    broker.publish_event("receipt.requested", json.dumps(body), event_id=eid)
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="conflict")
    other = dict(body, amount_cents=body["amount_cents"] + 1)
    broker.publish_event("payment.failed", json.dumps(other), event_id=eid)
    c.wait_metric("idem_consumer_dead_lettered_total", 2, code="conflict")
    assert c.metric("idem_consumer_duplicates_total") == 1
    assert db.dunning_step(sub) == 1
    assert db.count("billing.receipts") == 0


def test_conflict_inside_one_batch(db, queue, broker, consumers, dead_letters):
    """Two deliveries of one id with different contents in the same batch: the first is applied,
    the second is a conflict; a third with the first's content is a duplicate."""
    c = consumers("billing", queue, db)
    assert c.stop() == 0  # the queue exists and is bound; fill it while nobody consumes
    # a batch runs in subscription order: sub_a's delivery comes first however it is cut
    sub_a, sub_b = sorted([new_id(), new_id()])
    eid = new_id()
    warm = [broker.publish_event("payment.failed", payload(subscription_id=new_id()))
            for _ in range(20)]
    a = payload(subscription_id=sub_a)
    b = payload(subscription_id=sub_b)
    broker.publish_event("payment.failed", a, event_id=eid, headers={"subscription_id": sub_a})
    broker.publish_event("payment.failed", b, event_id=eid, headers={"subscription_id": sub_b})
    broker.publish_event("payment.failed", a, event_id=eid, headers={"subscription_id": sub_a})
    c2 = consumers("billing", queue, db)
    c2.wait_metric("idem_consumer_dead_lettered_total", 1, code="conflict")
    c2.wait_handled(len(warm) + 2)
    assert c2.metric("idem_consumer_applied_total") == len(warm) + 1
    assert c2.metric("idem_consumer_duplicates_total") == 1
    assert c2.metric("idem_consumer_dead_lettered_total") == 1
    dl = dead_letters(queue).wait(1)
    assert [m.header("subscription_id") for m in conflicts(dl)] == [sub_b]
    assert db.dunning_step(sub_a) == 1 and db.dunning_step(sub_b) is None


def test_ledger_rows_without_digest_are_duplicates(db, queue, broker, consumers):
    """Rows written before the ledger kept digests: whatever comes with their id is a duplicate,
    as before."""
    eid = new_id()
    db.execute("INSERT INTO idem.consumed_events (consumer, event_id) VALUES ('billing', %s)", eid)
    assert db.scalar("SELECT digest IS NULL FROM idem.consumed_events WHERE event_id = %s", eid)
    c = consumers("billing", queue, db)
    broker.publish_event("payment.failed", payload(), event_id=eid)
    c.wait_metric("idem_consumer_duplicates_total", 1)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.metric("idem_consumer_applied_total") == 0


def test_conflict_with_a_row_committed_while_the_claim_waited(db, queue, broker, consumers,
                                                              dead_letters):
    """The claim waits for a concurrent transaction holding the same id; that row, committed
    after the claim's statement began, is still compared (not taken for a duplicate)."""
    c = consumers("billing", queue, db, args=["--log-level", "debug"])
    eid = new_id()
    sub = new_id()
    broker.publish_event("payment.failed", payload(subscription_id=sub), event_id=new_id())
    c.wait_metric("idem_consumer_applied_total", 1)  # its digest shows the column's form
    other = db.scalar("SELECT encode(digest, 'hex') FROM idem.consumed_events LIMIT 1")
    assert other and len(other) == 64
    with db.connect(autocommit=False) as conn:
        with conn.cursor() as cur:
            cur.execute("INSERT INTO idem.consumed_events (consumer, event_id, digest) "
                        "VALUES ('billing', %s, decode(%s, 'hex'))", (eid, other))

        def commit_later():
            time.sleep(3)
            conn.commit()

        t = threading.Thread(target=commit_later)
        t.start()
        broker.publish_event("payment.failed", payload(subscription_id=sub), event_id=eid)
        t.join()
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="conflict", timeout=20)
    assert c.metric("idem_consumer_duplicates_total") == 0
    assert db.dunning_step(sub) == 1
    dl = dead_letters(queue).wait(1)
    assert [m.props.message_id for m in conflicts(dl)] == [eid]
    # the claim did wait (lock_timeout is 5 s) and read the row again in a statement of its own
    assert log_lines(c, r"committed by another transaction while the claim waited"), \
        c.log()[-3000:]
