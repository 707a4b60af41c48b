"""A handler that swallows a failed statement loses nothing.

A C handler takes the bare connection (idem_event_conn), runs a statement that fails
(SELECT 1/0), ignores the error and returns IDEM_DONE. The transaction is aborted, so PostgreSQL
answers the runtime's COMMIT with the tag ROLLBACK. The consumer must see that the COMMIT did not
commit: the event counts as a Retry-class failure (contract, "Failure policy"), is tried again,
and with --max-retries 1 ends in QUEUE.dlq as retries_exhausted, with no ledger row. Its
batch-mates, handled by a well-behaved handler in the same program, are applied exactly once, and
a later event of its own subscription waits behind it and is applied once it is dead-lettered.

Without the check of the COMMIT's answer, the consumer would ack an event that never took effect
(lost for good, with nothing in the DLQ); without the one-by-one fallback, the aborted batch would
sink or duplicate its batch-mates.
"""

import json

import pytest

from conftest import new_id
from consumer_helpers import as_program, build_prog, log_lines

SUB_LOW = "00000000-0000-4000-8000-000000000001"
SUB_MID = "80000000-0000-4000-8000-000000000002"
SUB_HIGH = "ffffffff-0000-4000-8000-000000000003"


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    return build_prog("swallow_consumer", tmp_path_factory.mktemp("progs"))


def swallow_consumer(consumers, prog, queue, db, max_retries=1):
    c = consumers("swallow", queue, db, start=False)
    return as_program(c, [prog, queue, str(c.metrics_port), str(max_retries)])


def body(sub):
    return json.dumps({"subscription_id": sub, "n": new_id()})


@pytest.fixture
def applied_table(db):
    db.execute("CREATE TABLE it_applied (event_id uuid PRIMARY KEY, subscription_id uuid NOT NULL,"
               " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())")


def test_swallowed_error_in_a_batch_is_retried_then_dead_lettered(db, queue, consumers, broker,
                                                                  dead_letters, prog,
                                                                  applied_table):
    # A first run declares and binds the queue; then everything is published while no consumer
    # runs, so that it arrives in one batch.
    first = swallow_consumer(consumers, prog, queue, db).start()
    assert first.stop() == 0
    c = swallow_consumer(consumers, prog, queue, db)

    good = []
    good.append(broker.publish_event("it.apply", body(SUB_LOW)))
    good.append(broker.publish_event("it.apply", body(SUB_HIGH)))
    bad = broker.publish_event("it.swallow", body(SUB_MID))
    good.append(broker.publish_event("it.apply", body(SUB_LOW)))
    good.append(broker.publish_event("it.apply", body(SUB_HIGH)))
    # Same subscription as the swallowed one, delivered after it: waits behind its retry, then
    # goes on once it is dead-lettered.
    behind = broker.publish_event("it.apply", body(SUB_MID))
    good.append(behind)
    for _ in range(5):
        good.append(broker.publish_event("it.apply", body(new_id())))

    c.start()
    letters = dead_letters(queue)
    letters.wait(1, timeout=20)
    c.wait_metric("idem_consumer_applied_total", len(good), timeout=15)
    # Retry class: first try + 1 retry, both failed; a reject would have taken one try.
    assert c.metric("idem_consumer_dead_lettered_total", code="retries_exhausted") == 1
    assert c.metric("idem_consumer_dead_lettered_total") == 1
    assert c.metric("idem_consumer_handler_errors_total") == 2
    assert c.metric("idem_consumer_duplicates_total") == 0
    assert c.stop() == 0
    dl = letters.poll()

    assert [d.props.message_id for d in dl] == [bad], dl
    d = dl[0]
    assert d.error.startswith("retries_exhausted: "), d.error
    assert d.props.type == "it.swallow"
    assert json.loads(d.body)["subscription_id"] == SUB_MID

    # The swallowed event left nothing; every batch-mate exactly once.
    assert db.ledger() == sorted(("swallow", e) for e in good)
    rows = db.query("SELECT event_id::text, count(*) FROM it_applied GROUP BY 1")
    assert sorted(r[0] for r in rows) == sorted(good)
    assert all(r[1] == 1 for r in rows)
    # Order: the event behind the swallowed one waited for its tries to be over (the retry comes
    # 1 s after the first try), while the batch-mates of other subscriptions did not.
    gap = db.scalar("SELECT extract(epoch FROM (SELECT applied_at FROM it_applied WHERE event_id"
                    " = %s) - min(applied_at)) FROM it_applied", behind)
    assert gap >= 0.9, f"applied {gap:.2f}s after the first batch-mate: did not wait behind"
    assert broker.depth(queue) == 0


def test_swallowed_error_alone_is_retried_then_dead_lettered(db, queue, consumers, broker,
                                                             dead_letters, prog, applied_table):
    """The same on a delivery that is tried in a transaction of its own (no batch-mates)."""
    c = swallow_consumer(consumers, prog, queue, db).start()
    bad = broker.publish_event("it.swallow", body(SUB_MID))
    c.wait_metric("idem_consumer_handler_errors_total", 1)
    dl = dead_letters(queue).wait(1, timeout=15)
    assert [d.props.message_id for d in dl] == [bad]
    assert dl[0].error.startswith("retries_exhausted: "), dl[0].error
    assert c.metric("idem_consumer_handler_errors_total") == 2
    assert c.metric("idem_consumer_applied_total") == 0

    after = broker.publish_event("it.apply", body(SUB_MID))
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.ledger() == [("swallow", after)]
    assert db.query("SELECT event_id::text FROM it_applied") == [(after,)]
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


@pytest.fixture
def raiser(db):
    """it_raise(code): raises SQLSTATE code while it_ctl.active; returns 1 otherwise."""
    db.execute("""
        CREATE TABLE it_ctl (active boolean NOT NULL); INSERT INTO it_ctl VALUES (true);
        CREATE FUNCTION it_raise(code text) RETURNS int LANGUAGE plpgsql AS $$
        BEGIN
            IF (SELECT active FROM it_ctl) THEN
                RAISE EXCEPTION 'it_raise: injected by the test' USING ERRCODE = code;
            END IF;
            RETURN 1;
        END $$;
    """)
    return lambda on: db.execute("UPDATE it_ctl SET active = %s", on)


def test_ignored_exec_failure_of_class_22_rejects(db, queue, consumers, broker, dead_letters,
                                                  prog, raiser):
    """idem/handler.h: after idem_event_exec reported a failure, "whatever the handler then
    returns, the consumer applies its failure policy to the recorded SQLSTATE". A handler that
    ignores a 22012 and returns IDEM_DONE: rejected at once (handler_rejected), not retried."""
    c = swallow_consumer(consumers, prog, queue, db, max_retries=5).start()
    eid = broker.publish_event("it.swallow_exec", json.dumps({"subscription_id": SUB_MID,
                                                              "code": "22012"}))
    letters = dead_letters(queue)
    try:
        letters.wait(1, timeout=5)
    except AssertionError:
        raise AssertionError(
            "not dead-lettered at once: the recorded 22012 was not applied as a reject; tries "
            f"so far {c.metric('idem_consumer_handler_errors_total'):.0f}:\n"
            + "\n".join(log_lines(c, r"try \d+ failed|dead-lettered"))) from None
    d = letters.got[0]
    assert d.props.message_id == eid
    assert d.error.startswith("handler_rejected: "), d.error
    assert "22012" in d.error
    assert c.metric("idem_consumer_handler_errors_total") == 1
    assert c.stop() == 0
    assert db.ledger() == []


def test_ignored_exec_failure_of_a_pause_class_pauses(db, queue, consumers, broker, dead_letters,
                                                      prog, raiser):
    """The same handler ignoring a 25006 (read-only): Pause, whatever it returned: no try spent
    (--max-retries 0 would dead-letter at the first), nothing dead-lettered; applied once after."""
    c = swallow_consumer(consumers, prog, queue, db, max_retries=0).start()
    eid = broker.publish_event("it.swallow_exec", json.dumps({"subscription_id": SUB_MID,
                                                              "code": "25006"}))
    letters = dead_letters(queue)
    try:
        c.wait_metric("idem_consumer_paused_total", 2, timeout=8, sqlstate="25006")
    except AssertionError:
        raise AssertionError(
            "no pause on the recorded 25006; dead-lettered: "
            f"{[d.error for d in letters.poll()]}:\n"
            + "\n".join(log_lines(c, r"try \d+ failed|dead-lettered|paused"))) from None
    assert letters.poll() == []
    raiser(False)
    c.wait_metric("idem_consumer_applied_total", 1, timeout=15)
    assert c.stop() == 0
    assert db.ledger() == [("swallow", eid)]
    assert letters.poll() == []
