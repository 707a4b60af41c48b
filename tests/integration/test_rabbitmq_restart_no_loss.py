"""RabbitMQ restarted under a running consumer: deliveries that were in hand (delivered, not
acked) come back after the restart and are applied once; events published after the restart are
applied too; the consumer reconnects by itself."""

import pytest

from conftest import new_id, payload, wait_until


@pytest.mark.slow
def test_rabbitmq_restart_under_running_consumer(servers, db, queue, consumers, broker,
                                                 dead_letters):
    # prefetch 2: of the 4 events published while it is blocked, 2 are in hand (unacked) and 2
    # still ready in the queue when the broker stops.
    c = consumers("billing", queue, db, args=["--prefetch", "2"])
    sub = new_id()
    ids = [broker.publish_event("payment.failed", payload(subscription_id=sub))]
    c.wait_metric("idem_consumer_applied_total", 1)

    # Hold the consumer inside its transaction: a SHARE lock blocks the handler's write to
    # dunning, so the next deliveries are in hand and unacked when the broker goes away.
    with db.connect(autocommit=False) as blocker:
        with blocker.cursor() as cur:
            cur.execute("LOCK TABLE billing.dunning IN SHARE MODE")
        for _ in range(4):
            ids.append(broker.publish_event("payment.failed", payload(subscription_id=sub)))
        wait_until(lambda: db.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'") >= 1, 10, 0.05, "the consumer blocked on the lock")
        servers.rmq_stop()
        blocker.commit()  # the consumer may now commit, but can no longer ack

    restarted = False
    try:
        wait_until(lambda: db.scalar("SELECT count(*) FROM pg_stat_activity WHERE "
                                     "datname = current_database() AND wait_event_type = 'Lock'")
                   == 0, 10, 0.05, "the consumer past the lock")
        assert c.running(), c.log()
        servers.rmq_start()
        restarted = True
    finally:
        if not restarted:
            servers.rmq_start()

    # After the restart: redelivered ones plus new ones.
    for _ in range(2):
        ids.append(broker.publish_event("payment.failed", payload(subscription_id=sub)))
    wait_until(lambda: len(db.ledger()) == len(ids), 40, 0.1,
               lambda: f"{len(ids)} ledger rows (have {len(db.ledger())})")
    # Everything settled: no message left in the queue, acked or not.
    wait_until(lambda: servers.queue_counts(queue) == (0, 0), 20, 0.2, "queue drained and acked")
    assert c.metric("idem_reconnects_total", server="rabbitmq") >= 1
    assert c.stop() == 0

    assert db.dunning_step(sub) == len(ids)
    assert db.ledger() == sorted(("billing", i) for i in ids)
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []
