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
from consumer_helpers import as_program, build_prog

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
