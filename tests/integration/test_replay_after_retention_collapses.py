"""A replay after retention collapses (contract, `idem_emit`: a replay of the same key, type and
subscription inserts nothing and returns the same id for as long as `retain --keys-keep` keeps
the key, also after the outbox row itself was deleted; the same key with another type or
subscription raises 23505 and inserts nothing).

Without the record of emitted keys, the outbox row is the only memory of a key: once retention
deleted it (7 days) and the ledger row (30 days), a business operation retried late (a job
re-run, a webhook redelivered) would insert a fresh outbox row under the same event id, and with
the ledger row gone the consumers would apply the event a second time: a second dunning step, a
second revenue entry. And without the 23505 a key reused for another event would silently drop
that event. Also covered: `retain --keys-keep` deletes exactly the old keys and refuses a window
shorter than the dedup window, and `idem_emit`'s headers reach the message (or are refused).
"""

import json

import psycopg2
import pytest

from conftest import new_id, payload, wait_until
from ops_helpers import parse_retain, stderr_line
from relay_helpers import declare_consumer_queue, idem, md5_uuid, outbox, read_queue, relay_once

TYPE = "payment.failed"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def emit_h(db, event_type, sub, key, body, headers=None, conn=None):
    sql = "SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb, %s::jsonb)::text"
    args = (event_type, sub, key, json.dumps(body),
            None if headers is None else json.dumps(headers))
    if conn is not None:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchone()[0]
    return db.scalar(sql, *args)


def assert_refused(db, sqlstate, *args, **kw):
    """idem_emit(*args) fails with sqlstate and leaves no outbox row and no key behind."""
    rows = db.count("idem.event_outbox"), db.count("idem.idem_emitted_keys")
    with pytest.raises(psycopg2.Error) as e:
        emit_h(db, *args, **kw)
    assert e.value.pgcode == sqlstate, (args, kw, e.value.pgcode, str(e.value))
    assert (db.count("idem.event_outbox"), db.count("idem.idem_emitted_keys")) == rows, "something inserted"
    return e.value


def relay_published(db, servers):
    r = relay_once(db, servers)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_replay_after_retention_collapses(db, servers, queues, broker, consumers):
    watch = queues.new("watch")           # read by the test: what went on the wire
    declare_consumer_queue(broker, watch, [TYPE])
    consumer_q = queues.new("billing")    # consumed by the bundled billing handlers
    sub = new_id()
    key = f"invoice-42:failed:{new_id()}"
    body = payload(subscription_id=sub)
    eid = emit_h(db, TYPE, sub, key, body, headers={"traceparent": TRACEPARENT, "tenant": "acme"})
    assert eid == md5_uuid(key)

    # While the outbox row exists: a replay collapses; another type or subscription is refused.
    assert emit_h(db, TYPE, sub, key, body) == eid
    e = assert_refused(db, "23505", "invoice.paid", sub, key, body)
    assert eid in (e.diag.message_detail or "") + str(e), e
    assert_refused(db, "23505", TYPE, new_id(), key, payload())
    assert db.count("idem.event_outbox") == 1

    c = consumers("billing", consumer_q, db)
    assert relay_published(db, servers) == "published 1, failed attempts 0, parked 0"
    wait_until(lambda: db.ledger("billing") == [("billing", eid)], 15, 0.1, "the event applied")
    assert c.stop() == 0
    assert db.dunning_step(sub) == 1

    # The emit's headers travel with the message, beside the relay's own.
    [m] = read_queue(broker, watch, expect=1)
    assert m.event_id == eid
    assert m.headers.get("traceparent") == TRACEPARENT, m.headers
    assert m.headers.get("tenant") == "acme", m.headers
    assert m.headers.get("event_id") == eid and m.headers.get("subscription_id") == sub

    # Forty days later: retention (defaults) deletes the outbox row and the ledger row; the key
    # is kept (400 days).
    db.execute("UPDATE idem.event_outbox SET created_at = now() - interval '40 days',"
               " sent_at = now() - interval '40 days'")
    db.execute("UPDATE idem.consumed_events SET consumed_at = now() - interval '40 days'")
    db.execute("UPDATE idem.idem_emitted_keys SET first_emitted_at = now() - interval '40 days'")
    r = idem(db, servers, "retain")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout, keys=True) == {
        "event_outbox": (1, 1), "consumed_events": (1, 1), "idem_emitted_keys": (0, 0)}, r.stdout
    assert db.count("idem.event_outbox") == 0 and db.count("idem.consumed_events") == 0

    # The late replay: same id, no outbox row, nothing for the relay, nothing applied again.
    assert emit_h(db, TYPE, sub, key, body, headers={"traceparent": TRACEPARENT}) == eid
    assert db.count("idem.event_outbox") == 0, outbox(db)
    assert relay_published(db, servers) == "published 0, failed attempts 0, parked 0"
    assert_refused(db, "23505", "invoice.paid", sub, key, body)
    assert_refused(db, "23505", TYPE, new_id(), key, payload())
    c2 = consumers("billing", consumer_q, db)
    assert read_queue(broker, watch, expect=0, timeout=1) == []
    assert c2.stop() == 0
    assert db.dunning_step(sub) == 1
    assert db.count("idem.consumed_events") == 0


def test_keys_keep_deletes_only_old_keys(db, servers):
    subs = [new_id() for _ in range(3)]
    keys = [f"k{i}:{new_id()}" for i in range(3)]
    ids = [emit_h(db, TYPE, s, k, payload(subscription_id=s)) for s, k in zip(subs, keys)]
    # Keys are aged from the first emit: retention moves each deleted row's key into the record
    # with the row's created_at.
    db.execute("UPDATE idem.event_outbox SET status = 'sent', sent_at = now() - interval '61 days',"
               " created_at = now() - CASE event_id"
               " WHEN %s::uuid THEN interval '59 days' ELSE interval '61 days' END", ids[2])
    assert db.count("idem.idem_emitted_keys") == 0, "an emit writes its key in its outbox row only"

    r = idem(db, servers, "retain", "--keys-keep", "60d", "--batch", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[2] == "idem_emitted_keys: deleted 2 rows in 2 batches", r.stdout
    assert parse_retain(r.stdout, keys=True) == {
        "event_outbox": (3, 3), "consumed_events": (0, 0), "idem_emitted_keys": (2, 2)}
    assert [r[0] for r in db.query("SELECT event_id::text FROM idem.idem_emitted_keys")] == [ids[2]]

    # The kept key still collapses a replay; a forgotten one is a new event (the documented
    # horizon of --keys-keep).
    assert emit_h(db, TYPE, subs[2], keys[2], payload(subscription_id=subs[2])) == ids[2]
    assert db.count("idem.event_outbox") == 0
    assert emit_h(db, TYPE, subs[0], keys[0], payload(subscription_id=subs[0])) == ids[0]
    assert db.count("idem.event_outbox") == 1


@pytest.mark.parametrize("args", [["--keys-keep", "10d"],
                                  ["--keys-keep", "29d"],
                                  ["--dedup-window", "60d", "--keys-keep", "59d"]])
def test_keys_keep_shorter_than_dedup_window_refused(db, servers, args):
    s = new_id()
    emit_h(db, TYPE, s, f"k:{new_id()}", payload(subscription_id=s))
    db.execute("UPDATE idem.event_outbox SET status = 'sent', sent_at = now() - interval '100 days',"
               " created_at = now() - interval '100 days'")
    assert idem(db, servers, "retain", "--keys-keep", "400d").returncode == 0
    r = idem(db, servers, "retain", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    line = stderr_line(r)
    assert line.startswith("idem retain: ") and "--force" in line, line
    assert r.stdout == ""
    assert db.count("idem.idem_emitted_keys") == 1

    r = idem(db, servers, "retain", *args, "--force")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout, keys=True)["idem_emitted_keys"] == (1, 1)
    assert db.count("idem.idem_emitted_keys") == 0


BAD_HEADERS = {
    "reserved": {"x-idem-seq": "7"},
    "reserved_any_case": {"X-Idem-Requeued": "1"},
    "reserved_error": {"x-idem-error": "stale: forged"},
    "number": {"n": 1},
    "null": {"n": None},
    "bool": {"n": True},
    "object": {"n": {"a": "b"}},
    "array": {"CC": ["a"]},
    "not_an_object": ["traceparent"],
    "string": "traceparent",
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_emit_headers_refused(db, case):
    s = new_id()
    assert_refused(db, "22023", TYPE, s, f"k:{new_id()}", payload(subscription_id=s),
                   headers=BAD_HEADERS[case])


def test_emit_headers_flat_strings_accepted(db):
    s = new_id()
    a = emit_h(db, TYPE, s, f"a:{new_id()}", payload(subscription_id=s),
               headers={"traceparent": TRACEPARENT, "tracestate": "", "x-custom": "1"})
    b = emit_h(db, TYPE, s, f"b:{new_id()}", payload(subscription_id=s), headers={})
    h = dict(db.query("SELECT event_id::text, headers FROM idem.event_outbox"))
    assert h[a] == {"traceparent": TRACEPARENT, "tracestate": "", "x-custom": "1"}
    assert h[b] is None


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_replay_racing_retention_collapses(db, servers, isolation):
    """Retention replaces a sent row by its key in one transaction, and idem_emit looks for the
    key in both places after its insert: an emit whose snapshot is older than the retention run
    (repeatable read) still sees the old row; a newer one (read committed) sees the key. Either
    way the replay inserts nothing and returns the same id, and another type is still 23505.
    Without the second look, the emit in the older snapshot would insert a new row under the old
    id: the event published and applied a second time once its ledger row is gone."""
    s = new_id()
    key = f"race:{new_id()}"
    eid = emit_h(db, TYPE, s, key, payload(subscription_id=s))
    db.execute("UPDATE idem.event_outbox SET status = 'sent', sent_at = now() - interval '8 days'")
    app = psycopg2.connect(db.url)
    try:
        with app.cursor() as cur:
            cur.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
            cur.execute("SELECT count(*) FROM idem.event_outbox")  # the snapshot is taken here
        r = idem(db, servers, "retain")
        assert r.returncode == 0, r.stderr
        assert parse_retain(r.stdout, keys=True)["event_outbox"] == (1, 1), r.stdout
        assert db.count("idem.idem_emitted_keys") == 1
        assert emit_h(db, TYPE, s, key, payload(subscription_id=s), conn=app) == eid
        with app.cursor() as cur:
            cur.execute("SELECT count(*) FROM idem.event_outbox WHERE event_id = %s", (eid,))
            visible = cur.fetchone()[0]
        app.commit()
        assert visible == (1 if isolation == "repeatable read" else 0), visible
    finally:
        app.close()
    assert db.count("idem.event_outbox") == 0, outbox(db)
    assert_refused(db, "23505", "invoice.paid", s, key, payload(subscription_id=s))
