"""Nothing is acked without its effect (contract, "Failure policy (consumer)").

- The consumer's commits are durable whatever the database's default: with
  `ALTER DATABASE ... SET synchronous_commit = off` (a common tuning) and PostgreSQL stopped
  with `-m immediate` while the consumer drains 3,000 events, an asynchronous COMMIT that the
  consumer acked could be lost in the crash, and a message acked is never delivered again: its
  effect would be gone for good. Every event must end with exactly one ledger row and its effect.
- A handler that ends the claim's transaction itself (COMMIT or ROLLBACK, on the connection from
  idem_event_conn or through idem_event_exec, or ROLLBACK and a BEGIN of its own), or turns
  synchronous_commit off, is dead-lettered `handler_rejected`: nothing of it commits (no ledger
  row, no effect), its batch-mates are applied exactly once, and the consumer goes on.
- The same for SQL handlers: COMMIT inside the function (2D000), SELECT ... INTO STRICT finding
  no row (P0002) or several (P0003), and settings changed with SET or set_config
  (synchronous_commit, search_path) reject the event instead of pausing the consumer for ever or
  committing with the handler's settings.
"""

import collections
import json
import time

import pytest

from conftest import new_id, payload, wait_until
from consumer_helpers import as_program, build_prog


def queued(consumers, queue, db, broker, n, nsubs, name="billing", args=()):
    """n payment.failed events over nsubs subscriptions queued while nobody consumes."""
    subs = [new_id() for _ in range(nsubs)]
    c0 = consumers(name, queue, db, args=args)
    assert c0.stop() == 0
    bodies = [payload(subscription_id=subs[i % nsubs]) for i in range(n)]
    return [(broker.publish_event("payment.failed", b), b) for b in bodies]


@pytest.mark.slow  # drains 3,000 events through an immediate stop of PostgreSQL: 1-2 minutes
def test_acked_effects_survive_a_crash_under_an_asynchronous_default(servers, db, queue,
                                                                     consumers, broker,
                                                                     dead_letters):
    dbname = db.scalar("SELECT current_database()")
    db.execute(f'ALTER DATABASE "{dbname}" SET synchronous_commit = off')
    events = queued(consumers, queue, db, broker, 3000, 300)
    c = consumers("billing", queue, db, start=False)
    c.start(wait_ready=False)
    # crash in the middle of the drain, while acked batches' commits may still be in memory
    wait_until(lambda: db.count("idem.consumed_events") >= 600 or None, 60, 0.005, "600 claims")
    servers.pg_stop_immediate()
    servers.pg_start()
    wait_until(lambda: broker.depth(queue) == 0 or None, 90, 0.2, "the queue drained")
    deadline = time.monotonic() + 30  # what was acked is never delivered again: wait, then count
    while db.count("idem.consumed_events") < 3000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.stop() == 0
    got = {eid for (_, eid) in db.ledger("billing")}
    lost = {eid for eid, _ in events} - got
    assert not lost, f"{len(lost)} events acked without their ledger row"
    assert db.count("idem.consumed_events") == 3000
    want = collections.Counter(b["subscription_id"] for _, b in events)
    assert dict(db.query("SELECT subscription_id::text, step FROM billing.dunning")) == dict(want)
    assert dead_letters(queue).poll() == []


# ----------------------------------------------------------------------------- C handlers

ENDERS = ["it.c_rollback", "it.c_commit", "it.c_rollback_begin", "it.exec_commit",
          "it.exec_rollback", "it.exec_async"]


@pytest.fixture(scope="module")
def ender(tmp_path_factory):
    return build_prog("txn_ender_consumer", tmp_path_factory.mktemp("progs"))


def ender_consumer(consumers, prog, queue, db):
    c = consumers("ender", queue, db, start=False)
    return as_program(c, [prog, queue, str(c.metrics_port)])


@pytest.fixture
def it_applied(db):
    db.execute("CREATE TABLE it_applied (event_id uuid NOT NULL, kind text NOT NULL)")


def test_c_handlers_that_end_the_transaction_are_rejected(db, queue, consumers, broker,
                                                          dead_letters, ender, it_applied):
    first = ender_consumer(consumers, ender, queue, db).start()
    assert first.stop() == 0
    good, bad = [], {}
    # one batch: every misbehaving handler between well-behaved ones, each on its own
    # subscription, and a well-behaved event behind each on the same subscription
    for t in ENDERS:
        good.append(broker.publish_event("it.apply", json.dumps({"subscription_id": new_id()})))
        sub = new_id()
        bad[broker.publish_event(t, json.dumps({"subscription_id": sub}))] = t
        good.append(broker.publish_event("it.apply", json.dumps({"subscription_id": sub})))
    c = ender_consumer(consumers, ender, queue, db).start()
    letters = dead_letters(queue).wait(len(ENDERS), timeout=30)
    c.wait_metric("idem_consumer_applied_total", len(good), timeout=30)
    time.sleep(0.5)  # nothing more may happen
    assert c.metric("idem_consumer_applied_total") == len(good)
    assert c.metric("idem_consumer_dead_lettered_total", code="handler_rejected") == len(ENDERS)
    assert c.metric("idem_consumer_paused_total") == 0, c.log()
    assert c.running()
    assert c.stop() == 0

    got = {d.props.message_id: d.error for d in letters}
    assert set(got) == set(bad), got
    for eid, err in got.items():
        assert err.startswith("handler_rejected: "), (bad[eid], err)
    for eid in bad:
        if bad[eid].startswith("it.c_rollback") or bad[eid] == "it.exec_rollback":
            assert "ended the claim's transaction" in got[eid], (bad[eid], got[eid])
    assert "synchronous_commit" in got[[e for e, t in bad.items() if t == "it.exec_async"][0]]
    # nothing of a misbehaving handler committed: no ledger row, no effect (not even the one a
    # handler wrote in a transaction of its own after its ROLLBACK and BEGIN)
    ledger = {eid for _, eid in db.ledger("ender")}
    assert ledger == set(good)
    effects = db.query("SELECT event_id::text, kind FROM it_applied")
    assert sorted(e for e, _ in effects) == sorted(good), effects
    assert broker.depth(queue) == 0


# ----------------------------------------------------------------------------- SQL handlers

SQL_SCHEMA = """
CREATE SCHEMA ender_sql;
CREATE TABLE ender_sql.applied (event_id uuid NOT NULL, event_type text NOT NULL);
CREATE FUNCTION ender_sql.handle(event_id uuid, event_type text, subscription_id uuid,
                                 payload jsonb, headers jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v uuid;
BEGIN
    INSERT INTO ender_sql.applied VALUES (event_id, event_type);
    CASE payload->>'mode'
    WHEN 'commit' THEN
        COMMIT;
    WHEN 'strict_none' THEN
        SELECT a.event_id INTO STRICT v FROM ender_sql.applied a WHERE false;
    WHEN 'strict_many' THEN
        INSERT INTO ender_sql.applied VALUES (event_id, event_type);
        SELECT a.event_id INTO STRICT v FROM ender_sql.applied a WHERE a.event_id = handle.event_id;
    WHEN 'set_async' THEN
        SET synchronous_commit = off;
    WHEN 'set_config_async' THEN
        PERFORM set_config('synchronous_commit', 'off', false);
    WHEN 'search_path' THEN
        PERFORM set_config('search_path', 'ender_sql, pg_catalog', false);
    ELSE
        NULL;
    END CASE;
END $$;
"""

MODES = ["commit", "strict_none", "strict_many", "set_async", "set_config_async", "search_path"]


def test_sql_handlers_that_break_the_transaction_are_rejected(db, queue, consumers, broker,
                                                              dead_letters):
    db.execute(SQL_SCHEMA)
    args = ["--handler", "it.sql=ender_sql.handle", "--max-retries", "1"]
    c0 = consumers("endersql", queue, db, args=args)
    assert c0.stop() == 0
    good, bad = [], {}
    for mode in MODES:
        good.append(broker.publish_event("it.sql", json.dumps({"mode": "ok"})))
        bad[broker.publish_event("it.sql", json.dumps({"mode": mode}))] = mode
    good.append(broker.publish_event("it.sql", json.dumps({"mode": "ok"})))
    c = consumers("endersql", queue, db, args=args)
    letters = dead_letters(queue).wait(len(MODES), timeout=30)
    c.wait_metric("idem_consumer_applied_total", len(good), timeout=30)
    time.sleep(0.5)
    assert c.metric("idem_consumer_applied_total") == len(good)
    assert c.metric("idem_consumer_dead_lettered_total", code="handler_rejected") == len(MODES)
    assert c.running()
    # and later events still go: the session's settings were not left changed
    late = broker.publish_event("it.sql", json.dumps({"mode": "ok"}))
    c.wait_metric("idem_consumer_applied_total", len(good) + 1, timeout=15)
    assert c.stop() == 0
    good.append(late)
    got = {d.props.message_id: d.error for d in letters}
    assert set(got) == set(bad), got
    for eid, err in got.items():
        assert err.startswith("handler_rejected: "), (bad[eid], err)
    want_text = {"commit": "2D000", "strict_none": "P0002", "strict_many": "P0003",
                 "set_async": "synchronous_commit", "set_config_async": "synchronous_commit",
                 "search_path": "search_path"}
    for eid, mode in bad.items():
        assert want_text[mode] in got[eid], (mode, got[eid])
    assert {eid for _, eid in db.ledger("endersql")} == set(good)
    assert sorted(r[0] for r in db.query("SELECT event_id::text FROM ender_sql.applied")) == \
        sorted(good)
