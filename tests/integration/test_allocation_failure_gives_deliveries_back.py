"""An allocation failure gives deliveries back.

IDEM_FAULT=consumer.nomem_window:5 (a testing seam) makes the 5th attempt to hold a delivery in
the consumer's window fail as an allocation failure would. The consumer cannot keep that delivery,
and must not ack it (nor the ones before it, which are not committed yet): it gives back
everything unacked by dropping its channel ("out of memory holding a delivery"), reconnects, and
the broker redelivers. All 20 events are then applied exactly once.

Without it, the delivery would be forgotten while its channel lives on: never acked, never
redelivered (a stuck unacked message until the process exits), or, worse, acked by a later
basic.ack(multiple) that covers its tag: lost.
"""

from conftest import new_id, payload
from consumer_helpers import log_lines


def test_allocation_failure_gives_deliveries_back(db, queue, consumers, broker, dead_letters):
    # A first run declares and binds the queue; the 20 events then wait in it, so that the
    # failure hits in the middle of a batch being read.
    assert consumers("billing", queue, db).stop() == 0
    c = consumers("billing", queue, db, fault="consumer.nomem_window:5", start=False)
    subs = [new_id() for _ in range(20)]
    ids = [broker.publish_event("payment.failed", payload(subscription_id=s)) for s in subs]
    c.start()
    c.wait_metric("idem_consumer_applied_total", 20, timeout=20)
    assert c.metric("idem_reconnects_total", server="rabbitmq") >= 1
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert log_lines(c, r"out of memory holding a delivery"), c.log()[-3000:]
    assert c.stop() == 0
    assert db.ledger() == sorted(("billing", e) for e in ids)
    assert [db.dunning_step(s) for s in subs] == [1] * 20
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0


def test_allocation_failure_while_consuming_gives_deliveries_back(db, queue, consumers, broker,
                                                                 dead_letters):
    """The same with events arriving one at a time to a running consumer."""
    c = consumers("billing", queue, db, fault="consumer.nomem_window:5")
    subs = [new_id() for _ in range(20)]
    ids = [broker.publish_event("payment.failed", payload(subscription_id=s)) for s in subs]
    c.wait_metric("idem_consumer_applied_total", 20, timeout=20)
    assert c.metric("idem_reconnects_total", server="rabbitmq") >= 1
    assert log_lines(c, r"out of memory holding a delivery"), c.log()[-3000:]
    assert c.stop() == 0
    assert db.ledger() == sorted(("billing", e) for e in ids)
    assert [db.dunning_step(s) for s in subs] == [1] * 20
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0
