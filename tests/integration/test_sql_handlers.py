"""SQL-function handlers: `idem consume --handler TYPE=SCHEMA.FUNCTION`.

The function is called as SCHEMA.FUNCTION(event_id uuid, event_type text, subscription_id uuid,
payload jsonb, headers jsonb) in the claim's transaction (contract, "Handlers in SQL"), so:
- what it writes commits with the claim: the same event id delivered 3 times is applied once;
- its errors follow the failure policy: RAISE EXCEPTION (P0001) dead-letters at once as
  handler_rejected; a serialization failure (40001) retries, then applies;
- a missing function is one line and exit 1 at start, not a consumer that dead-letters or
  pauses on every event;
- --bundled runs the bundled billing handlers beside it;
- batching works with it (50 events, each once, in far fewer transactions than events);
- it receives the message's headers (e.g. traceparent) as a JSON object.

Without these, teams that write handlers in SQL would get duplicate effects under redelivery,
poison events retried or silently dropped, or a typo in a function name turning into a consumer
that never applies anything.
"""

import json
import subprocess

import pytest

from conftest import new_id, payload, run_idem, wait_until
from consumer_helpers import log_lines

HANDLER = ["--handler", "payment.failed=billing_sql.on_failed"]

SCHEMA = """
CREATE SCHEMA billing_sql;
CREATE TABLE billing_sql.applied (
    event_id        uuid  NOT NULL,
    event_type      text  NOT NULL,
    subscription_id uuid,
    payload         jsonb NOT NULL,
    headers         jsonb,
    txid            bigint NOT NULL DEFAULT txid_current()
);
CREATE SEQUENCE billing_sql.tries;
CREATE FUNCTION billing_sql.on_failed(event_id uuid, event_type text, subscription_id uuid,
                                      payload jsonb, headers jsonb)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF payload->>'mode' = 'reject' THEN
        RAISE EXCEPTION 'billing_sql: refusing %', event_id;
    END IF;
    IF payload->>'mode' = 'serial' AND nextval('billing_sql.tries') = 1 THEN
        RAISE EXCEPTION 'billing_sql: serialization conflict' USING ERRCODE = '40001';
    END IF;
    INSERT INTO billing_sql.applied (event_id, event_type, subscription_id, payload, headers)
    VALUES (event_id, event_type, subscription_id, payload, headers);
END $$;
CREATE FUNCTION billing_sql.on_refund(event_id uuid, event_type text, subscription_id uuid,
                                      payload jsonb, headers jsonb)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO billing_sql.applied (event_id, event_type, subscription_id, payload, headers)
    VALUES (event_id, event_type, subscription_id, payload, headers);
END $$;
"""


@pytest.fixture
def sql_db(db):
    db.execute(SCHEMA)
    return db


def applied(db, event_id=None):
    if event_id is None:
        return db.count("billing_sql.applied")
    return db.count("billing_sql.applied", "event_id = %s", event_id)


def test_applied_once_under_redelivery(sql_db, queue, consumers, broker, dead_letters):
    db = sql_db
    c = consumers("sqlh", queue, db, args=HANDLER)
    body = payload()
    eid = new_id()
    for _ in range(3):
        broker.publish_event("payment.failed", body, event_id=eid)
    c.wait_handled(3)
    assert c.metric("idem_consumer_applied_total") == 1
    assert c.metric("idem_consumer_duplicates_total") == 2
    assert c.stop() == 0
    assert applied(db, eid) == 1
    row = db.query("SELECT event_type, subscription_id::text, payload FROM billing_sql.applied")
    assert row == [("payment.failed", body["subscription_id"], body)]
    assert db.ledger() == [("sqlh", eid)]
    # The SQL handler replaces the bundled ones: no dunning effect.
    assert db.count("billing.dunning") == 0
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0


def test_raise_exception_dead_letters_at_once(sql_db, queue, consumers, broker, dead_letters):
    db = sql_db
    c = consumers("sqlh", queue, db, args=HANDLER + ["--max-retries", "5"])
    raw = json.dumps(payload(mode="reject")).encode()
    eid = broker.publish_event("payment.failed", raw)
    # With 5 retries a retried event would take 31 s to come out: at once means no retry.
    letters = dead_letters(queue)
    letters.wait(1, timeout=10)
    assert c.metric("idem_consumer_handler_errors_total") == 1
    assert c.metric("idem_consumer_dead_lettered_total", code="handler_rejected") == 1
    ok = broker.publish_event("payment.failed", payload())
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    d = letters.got[0]
    assert d.props.message_id == eid and d.body == raw
    assert d.error.startswith("handler_rejected: "), d.error
    assert "billing_sql: refusing" in d.error
    assert applied(db, eid) == 0
    assert db.ledger() == [("sqlh", ok)]


def test_serialization_failure_retries_then_applies(sql_db, queue, consumers, broker,
                                                    dead_letters):
    db = sql_db
    c = consumers("sqlh", queue, db, args=HANDLER + ["--max-retries", "3"])
    eid = broker.publish_event("payment.failed", payload(mode="serial"))
    c.wait_metric("idem_consumer_handler_errors_total", 1)
    c.wait_metric("idem_consumer_applied_total", 1, timeout=10)
    assert c.metric("idem_consumer_handler_errors_total") == 1
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert log_lines(c, r"try 1 failed.*40001")
    assert c.stop() == 0
    assert applied(db, eid) == 1
    assert db.scalar("SELECT last_value FROM billing_sql.tries") == 2
    assert db.ledger() == [("sqlh", eid)]
    assert dead_letters(queue).poll() == []


def test_missing_function_exits_1_at_start(sql_db, queue, servers):
    r = run_idem("consume", "--consumer", "sqlh", "--queue", queue,
                 "--handler", "payment.failed=billing_sql.no_such_fn",
                 pg_url=sql_db.url, amqp_url=servers.amqp_url, timeout=30)
    assert r.returncode == 1, (r.returncode, r.stderr)
    naming = [line for line in r.stderr.splitlines() if "no_such_fn" in line]
    assert len(naming) == 1, r.stderr
    assert "billing_sql" in naming[0]
    assert r.stdout == ""


def test_missing_function_exits_1_also_with_bundled(sql_db, queue, servers):
    """--bundled adds the bundled handlers; it must not hide the --handler given for the same
    type (here a missing function): still one line and exit 1 at start (or, if giving a type
    both ways is refused, a usage error naming it, exit 2), never a consumer that runs."""
    try:
        r = run_idem("consume", "--consumer", "sqlh", "--queue", queue,
                     "--handler", "payment.failed=billing_sql.no_such_fn", "--bundled",
                     pg_url=sql_db.url, amqp_url=servers.amqp_url, timeout=8)
    except subprocess.TimeoutExpired:
        raise AssertionError("still consuming after 8 s: --bundled silently replaced --handler "
                             "payment.failed=billing_sql.no_such_fn, whose function was never "
                             "checked") from None
    lines = r.stderr.splitlines()
    if r.returncode == 2:
        assert len([ln for ln in lines if "payment.failed" in ln]) == 1, r.stderr
    else:
        assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
        assert len([ln for ln in lines if "no_such_fn" in ln]) == 1, r.stderr


def test_handler_wins_over_bundled_for_its_type(sql_db, queue, consumers, broker, dead_letters):
    """--handler payment.failed=... --bundled: the explicit SQL handler handles payment.failed
    ("only those run, plus the bundled ones"); the bundled payment.failed must not replace it
    silently. (Refusing the combination at start, exit 2, would be acceptable too.)"""
    db = sql_db
    c = consumers("sqlh", queue, db, args=HANDLER + ["--bundled"], start=False).spawn()
    info = lambda: broker.queue_info(queue)  # noqa: E731
    wait_until(lambda: not c.running() or (info() is not None and info()[1] >= 1), 20, 0.1,
               "the consumer consuming, or refusing the flags")
    if not c.running():
        assert c.proc.returncode == 2, c.log()
        assert len(log_lines(c, r"payment\.failed")) == 1, c.log()
        return
    body = payload()
    eid = broker.publish_event("payment.failed", body)
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.ledger() == [("sqlh", eid)]
    assert (applied(db, eid), db.dunning_step(body["subscription_id"])) == (1, None), \
        "payment.failed went to the bundled handler, not to --handler billing_sql.on_failed"


def test_bundled_handlers_run_too(sql_db, queue, consumers, broker, dead_letters):
    db = sql_db
    c = consumers("sqlh", queue, db, args=["--handler", "refund.issued=billing_sql.on_refund",
                                           "--bundled"])
    refund = broker.publish_event("refund.issued", payload())
    body = payload()
    failed = broker.publish_event("payment.failed", body)
    c.wait_metric("idem_consumer_applied_total", 2)
    assert c.stop() == 0
    assert applied(db, refund) == 1
    assert applied(db, failed) == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == sorted(("sqlh", e) for e in (refund, failed))
    assert dead_letters(queue).poll() == []


def test_batch_of_50_applied_once_in_batches(sql_db, queue, consumers, broker, dead_letters):
    db = sql_db
    assert consumers("sqlh", queue, db, args=HANDLER).stop() == 0  # declares and binds
    c = consumers("sqlh", queue, db, args=HANDLER, start=False)
    ids = [broker.publish_event("payment.failed", payload()) for _ in range(50)]
    c.start()
    c.wait_metric("idem_consumer_applied_total", 50, timeout=15)
    batches = c.metric("idem_batch_duration_seconds_count")
    assert c.metric("idem_consumer_handler_errors_total") == 0
    assert c.stop() == 0
    assert 1 <= batches <= 10, f"50 events took {batches:.0f} transactions: not batched"
    rows = db.query("SELECT event_id::text, count(*) FROM billing_sql.applied GROUP BY 1")
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert all(r[1] == 1 for r in rows)
    # Fewer transactions than events, seen from the database too.
    assert db.scalar("SELECT count(DISTINCT txid) FROM billing_sql.applied") <= 10
    assert db.ledger() == sorted(("sqlh", e) for e in ids)
    assert dead_letters(queue).poll() == []


def test_function_receives_the_headers(sql_db, queue, consumers, broker):
    db = sql_db
    c = consumers("sqlh", queue, db, args=HANDLER)
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sub = new_id()
    eid = broker.publish_event("payment.failed", payload(),
                               headers={"traceparent": tp, "subscription_id": sub})
    wait_until(lambda: applied(db, eid) == 1, 10, what="the SQL handler applied the event")
    assert c.stop() == 0
    headers, got_sub = db.query(
        "SELECT headers, subscription_id::text FROM billing_sql.applied WHERE event_id = %s",
        eid)[0]
    assert headers.get("traceparent") == tp, headers
    # The subscription the runtime passes is the relay's header when present.
    assert got_sub == sub
