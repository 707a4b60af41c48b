"""Least privilege in PostgreSQL: `idem migrate` creates the NOLOGIN roles idem_emitter,
idem_relay, idem_consumer and idem_operator; a login role that is a member of one can run exactly
the matching commands, and is denied what it must not do (each denial asserted with SQLSTATE
42501). idem_emit runs as its owner (SECURITY DEFINER) with a pinned search_path; PUBLIC cannot
execute it."""

import json
import time
import urllib.parse
import uuid

import psycopg2
import pytest

from conftest import admin_exec, new_id, payload, run_idem, wait_until
from relay_helpers import declare_consumer_queue, read_queue


def login(servers, db, group):
    """A new login role, member of group (or of none), and the database URL that logs in as it."""
    name = f"it_{group or 'nobody'}_{uuid.uuid4().hex[:8]}"
    member = f" IN ROLE {group}" if group else ""
    admin_exec(servers, f"CREATE ROLE {name} LOGIN{member}")
    u = urllib.parse.urlsplit(db.url)
    netloc = f"{name}@{u.hostname}:{u.port}"
    return name, urllib.parse.urlunsplit(u._replace(netloc=netloc))


@pytest.fixture
def role(servers, db):
    made = []

    def make(group):
        name, url = login(servers, db, group)
        made.append(name)
        return url

    yield make
    for name in made:
        admin_exec(servers, f"DROP OWNED BY {name}; DROP ROLE IF EXISTS {name}")


def denied(url, sql, *params):
    """Runs sql as the role of url; asserts it is refused for lack of privilege."""
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            with pytest.raises(psycopg2.Error) as e:
                cur.execute(sql, params or None)
        assert e.value.pgcode == "42501", (sql, e.value.pgcode, e.value.pgerror)
    finally:
        conn.close()


def allowed(url, sql, *params):
    conn = psycopg2.connect(url)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql, params or None)
            return cur.fetchall() if cur.description else None
    finally:
        conn.close()


EMIT = "SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb)::text"


def test_roles_exist_and_public_cannot_emit(db, role):
    rows = db.query("SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname LIKE 'idem\\_%' "
                    "ORDER BY 1")
    assert ("idem_consumer", False) in rows and ("idem_emitter", False) in rows
    assert ("idem_operator", False) in rows and ("idem_relay", False) in rows
    secdef, config = db.query("SELECT prosecdef, proconfig FROM pg_proc WHERE proname = "
                              "'idem_emit'")[0]
    assert secdef and any(c.startswith("search_path=") for c in config), config
    nobody = role(None)
    body = payload()
    denied(nobody, EMIT, "payment.failed", body["subscription_id"], new_id(), json.dumps(body))


def test_emitter_emits_and_touches_nothing_else(db, role):
    emitter = role("idem_emitter")
    body = payload()
    eid = allowed(emitter, EMIT, "payment.failed", body["subscription_id"], "k-1",
                  json.dumps(body))[0][0]
    assert db.scalar("SELECT count(*) FROM idem.event_outbox WHERE event_id = %s", eid) == 1
    denied(emitter, "SELECT * FROM idem.event_outbox")
    denied(emitter, "INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload) "
                    "VALUES (gen_random_uuid(), gen_random_uuid(), 't', '{}')")
    denied(emitter, "DELETE FROM idem.consumed_events")
    denied(emitter, "SELECT * FROM idem.idem_emitted_keys")


def test_relay_publishes_and_nothing_more(db, role, servers, broker, queues):
    relay = role("idem_relay")
    q = queues.new()
    declare_consumer_queue(broker, q, ["payment.failed"])
    body = payload()
    db.scalar(EMIT, "payment.failed", body["subscription_id"], "r-1", json.dumps(body))
    r = run_idem("relay", "--once", pg_url=relay, amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stderr
    assert db.count("idem.event_outbox", "status = 'sent'") == 1
    assert len(read_queue(broker, q)) == 1
    denied(relay, "INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload) "
                  "VALUES (gen_random_uuid(), gen_random_uuid(), 't', '{}')")
    denied(relay, "DELETE FROM idem.event_outbox")
    denied(relay, "UPDATE idem.event_outbox SET payload = '{}'")
    denied(relay, "SELECT * FROM idem.consumed_events")
    denied(relay, EMIT, "payment.failed", body["subscription_id"], "r-2", json.dumps(body))
    r = run_idem("retain", "--force", "--dedup-window", "1s", pg_url=relay)
    assert r.returncode == 1 and "permission denied" in r.stderr, r.stderr


def test_consumer_applies_and_nothing_more(db, role, queue, consumers, broker):
    consumer = role("idem_consumer")
    c = consumers("billing", queue, db, env={"IDEM_PG_URL": consumer})
    sub = new_id()
    e1 = broker.publish_event("payment.failed", payload(subscription_id=sub))
    e2 = broker.publish_event("invoice.paid", payload(subscription_id=sub))
    c.wait_metric("idem_consumer_applied_total", 2)
    assert c.stop() == 0
    assert db.ledger() == sorted(("billing", e) for e in (e1, e2))
    assert db.dunning_step(sub) == 0
    assert db.count("idem.event_outbox", "event_type = 'receipt.requested'") == 1
    denied(consumer, "SELECT * FROM idem.event_outbox")
    denied(consumer, "UPDATE idem.event_outbox SET status = 'sent'")
    denied(consumer, "DELETE FROM idem.consumed_events")
    denied(consumer, "DELETE FROM billing.dunning")
    r = run_idem("replay", "--all-failed", pg_url=consumer)
    assert r.returncode == 1, r.stderr


def test_operator_runs_operations_and_nothing_more(db, role, servers):
    op = role("idem_operator")
    body = payload()
    db.scalar(EMIT, "payment.failed", body["subscription_id"], "o-1", json.dumps(body))
    db.execute("UPDATE idem.event_outbox SET status = 'failed', attempts = 8")
    for args in (["status", "--json"], ["failed"], ["replay", "--all-failed"],
                 ["retain", "--outbox-keep", "1d", "--dedup-window", "1d"]):
        r = run_idem(*args, pg_url=op)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    assert db.count("idem.event_outbox", "status = 'pending'") == 1
    denied(op, "INSERT INTO idem.consumed_events (consumer, event_id) VALUES ('x', gen_random_uuid())")
    denied(op, "UPDATE idem.event_outbox SET payload = '{}'")
    denied(op, "INSERT INTO billing.dunning (subscription_id, step) VALUES (gen_random_uuid(), 1)")
    denied(op, EMIT, "payment.failed", body["subscription_id"], "o-2", json.dumps(body))


def test_consumer_writes_only_its_own_ledger_rows(db, role, queues, consumers, servers, broker):
    """A consumer name belongs to the role that first ran it (or the one idem's owner bound it
    to): another consumer role can neither write ledger rows under it, nor under any name it has
    not bound, nor start a consumer of that name. Without this, any consumer (or a handler running
    in its transaction) could pre-claim the event ids of another consumer, which would then drop
    the real events as duplicates."""
    first, second = role("idem_consumer"), role("idem_consumer")
    q = queues.new()
    c = consumers("billing", q, db, env={"IDEM_PG_URL": first})
    e1 = broker.publish_event("payment.failed", payload())
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.scalar("SELECT role::text FROM idem.idem_consumer_roles WHERE consumer = 'billing'") \
        == urllib.parse.urlsplit(first).username
    forged = "INSERT INTO idem.consumed_events (consumer, event_id) VALUES (%s, %s::uuid)"
    denied(second, forged, "billing", new_id())
    denied(second, forged, "never-bound", new_id())
    denied(first, forged, "never-bound", new_id())
    # its own name: allowed (the claim does exactly this)
    own = new_id()
    allowed(first, forged, "billing", own)
    assert db.ledger("billing") == sorted([("billing", e1), ("billing", own)])
    # the second role cannot take the name over by starting a consumer of that name
    r = run_idem("consume", "--consumer", "billing", "--queue", q, pg_url=second,
                 amqp_url=servers.amqp_url, timeout=30)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if "belongs to role" in line]
    assert len(lines) == 1 and urllib.parse.urlsplit(first).username in lines[0], r.stderr
    # once idem's owner binds the name to a group role, any member of it writes its rows
    db.execute("UPDATE idem.idem_consumer_roles SET role = 'idem_consumer' "
               "WHERE consumer = 'billing'")
    allowed(second, forged, "billing", new_id())


def test_operator_cannot_mark_pending_rows_sent_or_delete_them(db, role):
    """idem_operator changes rows only through idem's functions, which keep to the rules: it
    cannot mark a pending row sent (the event would never be published), delete a pending or
    failed row, rewrite the ledger, or replay a row older than the dedup window."""
    op = role("idem_operator")
    body = payload()
    pending = db.scalar(EMIT, "payment.failed", body["subscription_id"], "p-1", json.dumps(body))
    failed = db.scalar(EMIT, "payment.failed", body["subscription_id"], "p-2", json.dumps(body))
    db.execute("UPDATE idem.event_outbox SET status = 'failed', attempts = 8, "
               "created_at = now() - interval '40 days' WHERE event_id = %s", failed)
    db.execute("INSERT INTO idem.consumed_events (consumer, event_id, consumed_at) "
               "VALUES ('billing', gen_random_uuid(), now() - interval '1 hour')")
    denied(op, "UPDATE idem.event_outbox SET status = 'sent', sent_at = now() "
               "WHERE status = 'pending'")
    denied(op, "UPDATE idem.event_outbox SET status = 'pending' WHERE status = 'failed'")
    denied(op, "DELETE FROM idem.event_outbox WHERE status = 'pending'")
    denied(op, "DELETE FROM idem.event_outbox WHERE status = 'failed'")
    denied(op, "DELETE FROM idem.consumed_events")
    denied(op, "UPDATE idem.consumed_events SET consumed_at = now() - interval '1 year'")
    denied(op, "DELETE FROM idem.idem_emitted_keys")
    # the functions themselves refuse what the rules refuse, whatever the cutoff
    assert allowed(op, "SELECT idem.idem_retain_outbox(now() + interval '1 year', 1000)") == [(0,)]
    assert allowed(op, "SELECT idem.idem_retain_ledger(now() + interval '1 year', 1000)") == [(0,)]
    rows = allowed(op, "SELECT stale, replayed FROM idem.idem_replay(NULL, 2592000000)")
    assert rows == [(True, False)], rows  # stale for 30d: refused, nothing changed
    assert allowed(op, "SELECT count(*) FROM idem.idem_replay(%s::uuid, 2592000000)", pending) \
        == [(0,)]
    assert db.query("SELECT event_id::text, status FROM idem.event_outbox ORDER BY 1") == sorted(
        [(pending, "pending"), (failed, "failed")])
    assert db.count("idem.consumed_events") == 1
