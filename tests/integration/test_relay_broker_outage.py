"""RabbitMQ down while events are emitted: the relay daemon spends no attempt (a broker outage is
not the event's fault), keeps the rows pending, reconnects by itself and publishes everything
soon after the broker is back."""

import time

import pytest

from conftest import new_id, payload, wait_until
from relay_helpers import (declare_consumer_queue, emit_many, outbox, read_queue,
                           relay_daemons, status_counts)

__all__ = ["relay_daemons"]

N = 200


@pytest.mark.slow  # RabbitMQ stopped and started: 20-40 s
def test_broker_down_no_attempts_spent_all_sent_after_return(db, servers, queue, broker,
                                                             relay_daemons):
    if not servers.svc_dir:
        pytest.skip("needs servers started by scripts/services.sh (IDEM_SVC_DIR)")
    # The queue must exist and be bound before the outage: it is durable, so it survives it.
    declare_consumer_queue(broker, queue, ["payment.failed"])
    relay = relay_daemons(name="relay", wait_ready=True)

    # A control event goes through before the outage (the relay is really working).
    s0 = new_id()
    [first] = emit_many(db, [("payment.failed", s0, f"k:{s0}", payload(subscription_id=s0))])
    wait_until(lambda: outbox(db)[first]["status"] == "sent", 10, 0.05, "the control row sent")

    subs = [new_id() for _ in range(20)]
    restarted = False
    servers.rmq_stop()
    try:
        t_down = time.monotonic()
        ids = emit_many(db, [("payment.failed", subs[i % 20], f"k:{i}:{new_id()}",
                              payload(subscription_id=subs[i % 20], n=i)) for i in range(N)],
                        per_tx=10)
        # A few seconds with the broker down: nothing sent, nothing spent, relay still up.
        while time.monotonic() - t_down < 3:
            rows = outbox(db, "event_id = ANY(%s::uuid[])", ids)
            assert len(rows) == N
            assert {(v["status"], v["attempts"]) for v in rows.values()} == {("pending", 0)}, (
                status_counts(db))
            assert relay.running(), relay.log()[-3000:]
            time.sleep(0.2)
        assert db.scalar("SELECT count(*) FROM idem.event_outbox WHERE last_error IS NOT NULL") == 0
        servers.rmq_start()
        restarted = True
    finally:
        if not restarted:
            servers.rmq_start()
    t_up = time.monotonic()

    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == N + 1, 15, 0.1,
               lambda: f"all rows sent within 15 s of the broker's return "
                       f"(now {status_counts(db)})")
    took = time.monotonic() - t_up
    rows = outbox(db)
    assert {(v["status"], v["attempts"]) for v in rows.values()} == {("sent", 0)}
    assert db.scalar("SELECT count(*) FROM idem.event_outbox WHERE last_error IS NOT NULL") == 0
    assert relay.running()
    assert relay.stop() == 0

    got = read_queue(broker, queue, expect=N + 1)
    ids_got = [m.event_id for m in got]
    assert sorted(set(ids_got)) == sorted(ids + [first]), "every event published"
    assert len(ids_got) == N + 1, "no duplicates expected: nothing crashed"
    # Per subscription, emit order kept across the outage.
    for s in subs:
        ns = [m.n for m in got if m.sub == s]
        assert ns == sorted(ns), f"subscription {s}: {ns}"
    print(f"all {N} rows sent {took:.1f}s after the broker was back")
