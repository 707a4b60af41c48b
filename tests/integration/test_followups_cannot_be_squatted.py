"""Follow-up keys cannot be squatted. A handler's follow-up event (invoice.paid's
receipt.requested) goes through idem_emit_followup with the dedup key
idem:<parent event id>:<name>; idem_emit refuses keys in the namespace idem: (22023), so a role
that is only idem_emitter cannot take the key of a follow-up first. Before, the receipt's key was the
documented <invoice_id>:receipt: an emitter that emitted it first for another subscription made the
real invoice.paid fail (23505, dead-lettered, its revenue entry lost), and for the same subscription
its forged receipt stood in for the real one. idem_emit_followup is executable by idem_consumer only,
and only for a parent claimed in the caller's transaction."""

import json
import urllib.parse
import uuid

import psycopg2
import pytest

from conftest import admin_exec, new_id, payload, wait_until
from relay_helpers import emit, md5_uuid, relay_daemons

__all__ = ["relay_daemons"]

FOLLOWUP = "SELECT idem.idem_emit_followup(%s::uuid, %s, %s, %s::uuid, %s::jsonb)::text"
EMIT = "SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb)::text"


@pytest.fixture
def role(servers, db):
    """role(group) -> the URL of a new login role that is a member of group only."""
    made = []

    def make(group):
        name = f"it_{group}_{uuid.uuid4().hex[:8]}"
        admin_exec(servers, f"CREATE ROLE {name} LOGIN IN ROLE {group}")
        made.append(name)
        u = urllib.parse.urlsplit(db.url)
        return urllib.parse.urlunsplit(u._replace(netloc=f"{name}@{u.hostname}:{u.port}"))

    yield make
    for name in made:
        admin_exec(servers, f"DROP OWNED BY {name}; DROP ROLE IF EXISTS {name}")


def run_as(url, sql, *params):
    """sql as the role of url in a transaction of its own: its first column, or the error."""
    conn = psycopg2.connect(url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchone()[0]
    except psycopg2.Error as e:
        return e
    finally:
        conn.close()


def test_an_emitter_squatting_receipt_keys_changes_nothing(db, role, consumers, queue,
                                                           relay_daemons):
    emitter = role("idem_emitter")
    real_sub, evil_sub = new_id(), new_id()
    inv_other, inv_same = new_id(), new_id()
    paid = {inv: md5_uuid(f"invoice:{inv}:paid") for inv in (inv_other, inv_same)}

    # the emitter goes first: the old documented keys, for another subscription and (with a
    # forged amount) for the real one; the follow-ups' own keys are refused
    forged = {
        inv_other: run_as(emitter, EMIT, "receipt.requested", evil_sub, f"{inv_other}:receipt",
                          json.dumps(payload(subscription_id=evil_sub, invoice_id=inv_other))),
        inv_same: run_as(emitter, EMIT, "receipt.requested", real_sub, f"{inv_same}:receipt",
                         json.dumps(payload(subscription_id=real_sub, invoice_id=inv_same,
                                            amount_cents=1))),
    }
    assert all(isinstance(v, str) for v in forged.values()), forged
    for inv in (inv_other, inv_same):
        e = run_as(emitter, EMIT, "receipt.requested", real_sub, f"idem:{paid[inv]}:receipt",
                   json.dumps(payload(subscription_id=real_sub, invoice_id=inv)))
        assert isinstance(e, psycopg2.Error) and e.pgcode == "22023", e
        assert "reserved" in e.pgerror, e.pgerror

    # the real invoices are paid, relayed and applied
    bodies = {inv: payload(subscription_id=real_sub, invoice_id=inv, amount_cents=4200)
              for inv in (inv_other, inv_same)}
    for inv, body in bodies.items():
        assert emit(db, "invoice.paid", real_sub, f"invoice:{inv}:paid", body) == paid[inv]
    c = consumers("billing", queue, db)
    relay_daemons(name="relay", wait_ready=True)
    real = {inv: md5_uuid(f"idem:{paid[inv]}:receipt") for inv in paid}
    want = set(paid.values()) | set(real.values()) | set(forged.values())
    wait_until(lambda: {e for _, e in db.ledger()} >= want, 30, 0.1,
               lambda: f"every event applied (ledger {db.ledger()})")
    assert c.metric("idem_consumer_dead_lettered_total") == 0

    # each invoice: its revenue entry, and its real receipt (the real payload, the real
    # subscription, the follow-up's id) beside what the emitter emitted
    assert sorted(db.query("SELECT invoice_id::text, subscription_id::text, amount_cents, "
                           "event_id::text FROM billing.revenue_entries")) == sorted(
        (inv, real_sub, 4200, paid[inv]) for inv in paid)
    receipts = set(db.query("SELECT invoice_id::text, subscription_id::text, event_id::text "
                            "FROM billing.receipts"))
    for inv in paid:
        assert (inv, real_sub, real[inv]) in receipts, receipts
        assert db.scalar("SELECT payload FROM idem.event_outbox WHERE event_id = %s",
                         real[inv]) == bodies[inv]
    assert len(receipts) == 4  # the two real ones and the emitter's own two events


def test_followups_only_for_a_claimed_parent_and_only_by_consumers(db, role):
    emitter, consumer = role("idem_emitter"), role("idem_consumer")
    parent, sub = new_id(), new_id()
    body = json.dumps(payload(subscription_id=sub))
    args = (parent, "receipt", "receipt.requested", sub, body)

    # PUBLIC and emitters cannot execute it
    e = run_as(emitter, FOLLOWUP, *args)
    assert isinstance(e, psycopg2.Error) and e.pgcode == "42501", e
    rows = db.query("SELECT r.rolname FROM pg_roles r WHERE has_function_privilege(r.oid, "
                    "'idem.idem_emit_followup(uuid, text, text, uuid, jsonb, jsonb)', 'EXECUTE') "
                    "AND r.rolname LIKE 'idem\\_%' ORDER BY 1")
    assert rows == [("idem_consumer",)], rows

    # a consumer: not for a parent this transaction did not claim (none, or another
    # transaction's), even as idem's owner
    for url in (consumer, db.url):
        e = run_as(url, FOLLOWUP, *args)
        assert isinstance(e, psycopg2.Error) and e.pgcode == "22023", e
        assert "not claimed in this transaction" in e.pgerror
    db.execute("INSERT INTO idem.consumed_events (consumer, event_id) VALUES ('other', %s)",
               parent)
    e = run_as(consumer, FOLLOWUP, *args)
    assert isinstance(e, psycopg2.Error) and e.pgcode == "22023", e
    assert db.count("idem.event_outbox") == 0

    # in the claim's transaction: the follow-up's id is md5 of idem:<parent>:<name>, and a
    # redelivered parent (claimed again after a rollback) collapses into it
    claim = "INSERT INTO idem.consumed_events (consumer, event_id) VALUES (%s, %s::uuid)"
    got = []
    for name in ("billing", "billing-replica"):
        conn = psycopg2.connect(consumer)
        try:
            with conn, conn.cursor() as cur:
                # as the consumer runtime does at start: the name is bound to this role
                cur.execute("SELECT idem.idem_consumer_bind(%s)", (name,))
                cur.execute(claim, (name, parent))
                cur.execute(FOLLOWUP, args)
                got.append(cur.fetchone()[0])
        finally:
            conn.close()
    assert got == [md5_uuid(f"idem:{parent}:receipt")] * 2
    assert db.query("SELECT event_type, subscription_id::text FROM idem.event_outbox") == [
        ("receipt.requested", sub)]


def test_a_redelivered_invoice_paid_of_an_older_idem_gives_no_second_receipt(
        db, broker, consumers, queue, relay_daemons):
    """An older idem's invoice.paid applied its effects and emitted its receipt under the old key
    <invoice_id>:receipt in the claim's transaction; the delivery was not acked (the consumer died
    after the commit). After the upgrade, the redelivery is a duplicate by the ledger, so its
    handler, and with it the new follow-up key, never runs: one receipt."""
    sub, inv = new_id(), new_id()
    body = payload(subscription_id=sub, invoice_id=inv, amount_cents=900)
    paid = md5_uuid(f"invoice:{inv}:paid")
    # what the older idem committed: the ledger row, the revenue entry, the old-key receipt
    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO idem.consumed_events (consumer, event_id) VALUES ('billing', %s)",
                    (paid,))
        cur.execute("INSERT INTO billing.revenue_entries (invoice_id, subscription_id, "
                    "amount_cents, currency, event_id) VALUES (%s, %s, 900, 'USD', %s)",
                    (inv, sub, paid))
        cur.execute(EMIT, ("receipt.requested", sub, f"{inv}:receipt", json.dumps(body)))
        old_receipt = cur.fetchone()[0]
        conn.commit()
    c = consumers("billing", queue, db)
    broker.publish_event("invoice.paid", body, event_id=paid)  # the redelivery
    relay_daemons(name="relay", wait_ready=True)
    wait_until(lambda: db.count("billing.receipts") >= 1, 30, 0.1, "the old receipt applied")
    c.wait_metric("idem_consumer_duplicates_total", 1)
    assert db.query("SELECT event_id::text FROM billing.receipts") == [(old_receipt,)]
    assert db.count("billing.revenue_entries") == 1
    assert db.count("idem.event_outbox") == 1, "no follow-up emitted for the redelivery"
