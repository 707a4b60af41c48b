"""Database trouble pauses the consumer and dead-letters nothing.

A trigger makes the handler's write fail with 25006 (read-only transaction), 53100 (disk full) or
42501 (insufficient privilege), or makes the runtime's own claim in consumed_events fail with
53100. None of these says anything about the event: the contract ("Failure policy (consumer)")
classes them as Pause: the consumer spends no try, dead-letters nothing, logs at error level,
counts idem_consumer_paused_total{sqlstate}, and redoes the deliveries until the cause is gone;
then each event is applied exactly once.

The consumer runs with --max-retries 0, so a single try spent would dead-letter the event at once
as retries_exhausted: nothing in QUEUE.dlq proves no try was spent. Without the Pause class, a
failover to a read-only replica, a full disk or a revoked grant would empty the queue into the
DLQ within seconds. (P0001 and 23514 still reject: test_failing_handler_retried_then_dead_lettered.)
"""

import pytest

from conftest import new_id, payload
from consumer_helpers import add_failure, drop_failure, log_lines

CASES = [
    ("billing.dunning", "25006"),
    ("billing.dunning", "53100"),
    ("billing.dunning", "42501"),
    ("idem.consumed_events", "53100"),
]


@pytest.mark.parametrize("table,code", CASES,
                         ids=[f"{t}-{c}" for t, c in CASES])
def test_database_trouble_pauses_and_dead_letters_nothing(db, queue, consumers, broker,
                                                          dead_letters, table, code):
    events = "INSERT" if table == "idem.consumed_events" else "INSERT OR UPDATE"
    add_failure(db, table, code, events=events)
    c = consumers("billing", queue, db, args=["--max-retries", "0"])
    subs = [new_id(), new_id()]
    first = broker.publish_event("payment.failed", payload(subscription_id=subs[0]))
    c.wait_metric("idem_consumer_paused_total", 1, sqlstate=code)
    # Published during the pause: also waits, also not dead-lettered.
    second = broker.publish_event("payment.failed", payload(subscription_id=subs[1]))
    # It keeps trying (each try that fails is one more pause), and spends nothing.
    c.wait_metric("idem_consumer_paused_total", 3, timeout=15, sqlstate=code)

    letters = dead_letters(queue)
    assert letters.poll() == [], "database trouble dead-lettered an event"
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.metric("idem_consumer_applied_total") == 0
    assert c.running()
    errors = log_lines(c, rf" error +consumer: .*{code}")
    assert errors, f"no error-level log line naming {code}:\n{c.log()[-3000:]}"
    assert db.ledger() == []
    assert db.count("billing.dunning") == 0

    drop_failure(db, table)
    c.wait_metric("idem_consumer_applied_total", 2, timeout=15)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.metric("idem_consumer_duplicates_total") == 0
    assert c.stop() == 0
    assert db.ledger() == sorted(("billing", e) for e in (first, second))
    assert [db.dunning_step(s) for s in subs] == [1, 1]
    assert letters.poll() == []
    assert broker.depth(queue) == 0
