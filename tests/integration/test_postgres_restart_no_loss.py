"""PostgreSQL restarted under a running consumer: the consumer reconnects by itself and every
event, whether published before, during or after the outage, is applied exactly once."""

import time

from conftest import new_id, payload


def test_postgres_restart_under_running_consumer(servers, db, queue, consumers, broker,
                                                 dead_letters):
    c = consumers("billing", queue, db)
    sub = new_id()
    ids = [broker.publish_event("payment.failed", payload(subscription_id=sub))]
    c.wait_metric("idem_consumer_applied_total", 1)

    servers.pg_stop()
    try:
        # Published while PostgreSQL is down: the consumer cannot apply them yet.
        for _ in range(4):
            ids.append(broker.publish_event("payment.failed", payload(subscription_id=sub)))
        time.sleep(1.0)  # an outage long enough for failed reconnects
        assert c.running(), c.log()
        assert c.metric("idem_consumer_applied_total") == 1
    finally:
        servers.pg_start()

    c.wait_metric("idem_consumer_applied_total", 5, timeout=30)
    ids.append(broker.publish_event("payment.failed", payload(subscription_id=sub)))
    c.wait_metric("idem_consumer_applied_total", 6)
    assert c.metric("idem_reconnects_total", server="postgres") >= 1
    assert c.stop() == 0

    assert db.dunning_step(sub) == 6
    assert db.ledger() == sorted(("billing", i) for i in ids)
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []
