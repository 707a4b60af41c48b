"""The outbox emitter: the business write and the event row commit or roll back together, a
replayed emit collapses into one row (event id = md5(dedup key)::uuid), `idem emit` prints the id
alone and is idempotent, and NOTIFY idem_outbox reaches listeners only at commit."""

import json
import select
import time

import psycopg2

from conftest import new_id, payload
from relay_helpers import emit, idem, md5_uuid

INVOICES = """
CREATE TABLE invoices (
    invoice_id      uuid PRIMARY KEY,
    subscription_id uuid NOT NULL,
    status          text NOT NULL,
    amount_cents    bigint NOT NULL
)"""


def make_invoice(db):
    inv, sub = new_id(), new_id()
    db.execute(INVOICES)
    db.execute("INSERT INTO invoices VALUES (%s, %s, 'open', 1250)", inv, sub)
    return inv, sub


def pay_invoice(conn, inv, sub):
    """The business transaction's body: mark the invoice paid and emit invoice.paid."""
    with conn.cursor() as cur:
        cur.execute("UPDATE invoices SET status = 'paid' WHERE invoice_id = %s", (inv,))
        assert cur.rowcount == 1
    return emit(None, "invoice.paid", sub, f"invoice:{inv}:paid",
                payload(subscription_id=sub, invoice_id=inv), conn=conn)


def test_rolled_back_business_transaction_leaves_nothing(db):
    inv, sub = make_invoice(db)
    with db.connect(autocommit=False) as conn:
        eid = pay_invoice(conn, inv, sub)
        assert eid == md5_uuid(f"invoice:{inv}:paid")
        # visible inside the transaction ...
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM idem.event_outbox")
            assert cur.fetchone()[0] == 1
        # ... and to nobody else before the commit
        assert db.count("idem.event_outbox") == 0
        conn.rollback()
    assert db.count("idem.event_outbox") == 0
    assert db.scalar("SELECT status FROM invoices WHERE invoice_id = %s", inv) == "open"

    # A transaction that fails after the emit (an error, not an explicit rollback) likewise.
    with db.connect(autocommit=False) as conn:
        pay_invoice(conn, inv, sub)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1 / 0")
        except psycopg2.errors.DivisionByZero:
            conn.rollback()
        else:
            raise AssertionError("expected division by zero")
    assert db.count("idem.event_outbox") == 0
    assert db.scalar("SELECT status FROM invoices WHERE invoice_id = %s", inv) == "open"


def test_committed_business_transaction_leaves_both(db):
    inv, sub = make_invoice(db)
    with db.connect(autocommit=False) as conn:
        eid = pay_invoice(conn, inv, sub)
        conn.commit()
    assert db.scalar("SELECT status FROM invoices WHERE invoice_id = %s", inv) == "paid"
    rows = db.query("SELECT event_id::text, subscription_id::text, event_type, payload, status,"
                    " attempts, sent_at, last_error FROM idem.event_outbox")
    assert rows == [(eid, sub, "invoice.paid", payload(subscription_id=sub, invoice_id=inv),
                     "pending", 0, None, None)]
    assert eid == md5_uuid(f"invoice:{inv}:paid")


def test_same_dedup_key_twice_leaves_one_row(db):
    sub = new_id()
    key = f"dunning:{sub}:2026-11"
    first = payload(subscription_id=sub, amount_cents=100)
    second = payload(subscription_id=sub, amount_cents=999)
    with db.connect(autocommit=False) as conn:
        id1 = emit(None, "payment.failed", sub, key, first, conn=conn)
        conn.commit()
    with db.connect(autocommit=False) as conn:
        id2 = emit(None, "payment.failed", sub, key, second, conn=conn)
        conn.commit()
    assert id1 == id2 == md5_uuid(key)
    assert db.scalar("SELECT md5(%s)::uuid::text", key) == id1
    rows = db.query("SELECT event_id::text, payload FROM idem.event_outbox")
    assert rows == [(id1, first)], "the replay must neither add a row nor overwrite the first"

    # Twice in one transaction: still one row, same id.
    key2 = f"{key}:other"
    with db.connect(autocommit=False) as conn:
        a = emit(None, "payment.failed", sub, key2, first, conn=conn)
        b = emit(None, "payment.failed", sub, key2, first, conn=conn)
        conn.commit()
    assert a == b == md5_uuid(key2)
    assert db.count("idem.event_outbox") == 2


def test_idem_emit_cli_prints_the_id_and_is_idempotent(db, servers):
    sub = new_id()
    key = f"invoice:{new_id()}:paid"
    body = payload(subscription_id=sub)
    args = ("emit", "--type", "invoice.paid", "--subscription", sub, "--key", key,
            "--payload", json.dumps(body))
    r1 = idem(db, servers, *args)
    assert r1.returncode == 0, r1.stderr
    assert r1.stdout == md5_uuid(key) + "\n", f"stdout must be the id alone: {r1.stdout!r}"
    r2 = idem(db, servers, *args)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout == r1.stdout
    rows = db.query("SELECT event_id::text, subscription_id::text, event_type, payload, status"
                    " FROM idem.event_outbox")
    assert rows == [(md5_uuid(key), sub, "invoice.paid", body, "pending")]

    # Another key: another row.
    r3 = idem(db, servers, *args[:6], key + ":2", "--payload", json.dumps(body))
    assert r3.returncode == 0, r3.stderr
    assert r3.stdout == md5_uuid(key + ":2") + "\n"
    assert db.count("idem.event_outbox") == 2


def notifications(conn, wait):
    """Notifications on conn within `wait` seconds (all of them, drained)."""
    got = []
    deadline = time.monotonic() + wait
    while True:
        conn.poll()
        while conn.notifies:
            got.append(conn.notifies.pop(0))
        left = deadline - time.monotonic()
        if left <= 0:
            return got
        select.select([conn], [], [], left)


def test_notify_delivered_only_at_commit(db):
    """While a relay says it is idle (its row in idem_relay_idle), an emit notifies it, and
    only at commit."""
    inv, sub = make_invoice(db)
    with db.connect() as listener:
        with listener.cursor() as cur:
            cur.execute("LISTEN idem_outbox")
            cur.execute("INSERT INTO idem.idem_relay_idle (pid) VALUES (pg_backend_pid())")

        # Rolled back: nothing, ever.
        with db.connect(autocommit=False) as conn:
            pay_invoice(conn, inv, sub)
            assert notifications(listener, 0.3) == []
            conn.rollback()
        assert notifications(listener, 0.3) == []

        # Committed: nothing before the commit, one notification after.
        with db.connect(autocommit=False) as conn:
            pay_invoice(conn, inv, sub)
            emit(None, "payment.failed", sub, f"x:{new_id()}", payload(subscription_id=sub),
                 conn=conn)
            assert notifications(listener, 0.5) == [], "NOTIFY must wait for the commit"
            conn.commit()
        got = notifications(listener, 0.5)
        assert [n.channel for n in got] == ["idem_outbox"]
        assert db.count("idem.event_outbox") == 2


def test_no_notify_while_every_relay_is_busy(db):
    """A NOTIFY makes PostgreSQL commit notifying transactions one at a time: with no relay
    waiting for one (no idle row), an emit commits without it."""
    inv, sub = make_invoice(db)
    with db.connect() as listener:
        with listener.cursor() as cur:
            cur.execute("LISTEN idem_outbox")
        with db.connect(autocommit=False) as conn:
            pay_invoice(conn, inv, sub)
            conn.commit()
        assert notifications(listener, 0.5) == []
        assert db.count("idem.event_outbox") == 1
