"""A partitioned group keeps each subscription's order across RabbitMQ restarts with a backlog.

`idem consume --partitions 12` (two processes) declares its group. Then, three times: with the
consumers stopped, a part of 120 subscriptions' payment.failed / invoice.paid sequences is
emitted through idem_emit and published by `idem relay` (a backlog in the partitions) and
RabbitMQ is stopped and started. Last, the consumers start again and the last part is emitted
while they drain the backlog. Contract ("Order and
scale-out"): a subscription's partition follows from its id (the relay's shard key), so no
restart moves it, and every event is applied once with each subscription's effects in emit
order (audit of group_helpers).

With a consistent-hash exchange (an older idem) RabbitMQ 3.10 rebuilds the ring at each restart
from the bindings in the order it recovers them: a subscription's parts can wait in different
partitions, and one be applied before an earlier one."""

import time

import pytest

from conftest import wait_until
from group_helpers import (Emitter, audit, group_consumers, group_queue, install_effect_log,
                           partition_of, partitions, plan_billing)
from relay_helpers import relay_daemons

__all__ = ["group_consumers", "group_queue", "relay_daemons"]

P = 12
SUBS = 120
PER_SUB = 10
RESTARTS = 3


@pytest.mark.slow  # three RabbitMQ restarts: 20-77 s each on a loaded machine
def test_partitioned_backlog_keeps_order_across_rabbitmq_restarts(
        db, servers, broker, group_queue, group_consumers, relay_daemons):
    q = group_queue("restart")
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=31)
    args = ["--partitions", str(P)]
    parts = RESTARTS + 1
    chunks = [order[i * len(order) // parts:(i + 1) * len(order) // parts] for i in range(parts)]
    procs = [group_consumers("billing", q, db, args, label=f"c{i}") for i in range(2)]
    relay_daemons(["--poll-interval", "50ms"], wait_ready=True)

    def emit(chunk):
        e = Emitter(db.url, chunk, rate=2000.0, per_tx=10)
        e.start()
        return e

    def sent(n):
        wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") >= n, 90, 0.1,
                   lambda: f"{n} rows sent (have {db.count('idem.event_outbox', 'status = %s', 'sent')})")

    where = partition_of(list(plan), P)
    emitted = 0
    for p in procs:
        assert p.stop() == 0, p.log()[-3000:]

    for r in range(RESTARTS):
        emit(chunks[r]).finish()
        emitted += len(chunks[r])
        sent(emitted)
        backlog = sum(broker.depth(n) for n in partitions(q, P))
        assert backlog > 0, "no backlog in the partitions"
        t0 = time.monotonic()
        servers.rmq_stop()
        servers.rmq_start()
        print(f"\nrestart {r + 1}: backlog {backlog}, RabbitMQ back after "
              f"{time.monotonic() - t0:.1f} s")
        # the backlog is where each subscription's shard says, restart or not
        want = [sum(where[e.sub] == i for e in order[:emitted]) for i in range(P)]
        assert [broker.depth(n) for n in partitions(q, P)] == want

    for p in procs:
        p.start()
    last = emit(chunks[-1])
    last.finish()
    total = len(order) + sum(e.type == "invoice.paid" for e in order)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 120, 0.2,
               lambda: f"{total} ledger rows (have "
               f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')})")
    for p in procs:
        assert p.running(), f"{p.name} exited:\n{p.log()[-3000:]}"
    summary = audit(db.query, plan)
    assert summary["ledger_rows"] == total
    for name in partitions(q, P):
        assert broker.queue_info(name)[0] == 0, f"{name} still holds messages"
    assert broker.depth(q + ".dlq") == 0, broker.get_all(q + ".dlq")[:3]
