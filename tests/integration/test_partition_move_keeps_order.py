"""A subscription that RabbitMQ's hash ring moves to another partition keeps its order.

RabbitMQ 3.10's consistent-hash exchange rebuilds its ring when the broker restarts, in the
order the bindings happen to be recovered, so a subscription can move to another partition:
its events published before the restart still wait in the old partition, the later ones arrive
in the new one, where another process may apply them first. The test makes that happen without a
restart, deterministically: the partitions are unbound from QUEUE.hash and bound again in
reverse order between the first and the second half of each subscription's events.

Every subscription has been applied from its first partition before (a route is recorded). Then
the processes of the new partitions start first, the old ones 3 s later. Each subscription's
effects must still be its events in emit order (dunning changes and revenue entries, logged by
triggers), each once, with the right final step; the moved subscriptions are reported (one info
line each, naming the fence) and no fence is left behind. Without the fences, the later events
of every moved subscription would be applied during those 3 s, ahead of the earlier ones.
"""

import time

import pika

from conftest import wait_until
from group_helpers import (audit, group_consumers, group_queue, install_effect_log, partition_of,
                           partitions, plan_billing)
from relay_helpers import relay_daemons

__all__ = ["group_consumers", "group_queue", "relay_daemons"]

P = 4
SUBS = 80
PER_SUB = 6


def bind_partitions(amqp_url, queue, order):
    """Unbinds every partition from QUEUE.hash, then binds them again in the given order: the
    ring numbers its buckets in binding order, so this moves subscriptions between partitions."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        for name in partitions(queue, P):
            ch.queue_unbind(name, queue + ".hash", routing_key="1")
        for i in order:
            ch.queue_bind(f"{queue}.p{i}", queue + ".hash", routing_key="1")
    finally:
        conn.close()


def publish(broker, events):
    for e in events:
        broker.publish_event(e.type, e.body, event_id=e.id, headers={"subscription_id": e.sub})


def test_moved_subscription_keeps_its_order(db, servers, broker, group_queue, group_consumers,
                                            relay_daemons):
    q = group_queue("move")
    install_effect_log(db)
    plan, _ = plan_billing(SUBS, PER_SUB, seed=11)
    args = ["--partitions", str(P)]
    first = group_consumers("billing", q, db, args, label="declare")
    assert first.stop() == 0

    # where the ring sends each subscription now (sorted binding order), and after a reversal
    subs = list(plan)
    before = partition_of(servers.amqp_url, q, P, subs)
    bind_partitions(servers.amqp_url, q, reversed(range(P)))
    after = partition_of(servers.amqp_url, q, P, subs)
    moved = {s for s in subs if before[s] != after[s]}
    assert len(moved) >= SUBS // 3, f"only {len(moved)} of {SUBS} subscriptions would move"
    bind_partitions(servers.amqp_url, q, sorted(range(P), key=lambda i: f"p{i}"))
    assert partition_of(servers.amqp_url, q, P, subs) == before

    # every subscription's first event applied under the first ring (each now has a route),
    # then the rest of the first half published under it, the second half under the reversed one
    half = PER_SUB // 2
    warm = group_consumers("billing", q, db, args, label="warm")
    publish(broker, [plan[s][0] for s in subs])
    wait_until(lambda: db.scalar("SELECT count(*) FROM idem_partition_routes") == SUBS, 30, 0.1,
               "a route for every subscription")
    assert warm.stop() == 0
    publish(broker, [e for s in subs for e in plan[s][1:half]])
    bind_partitions(servers.amqp_url, q, reversed(range(P)))
    publish(broker, [e for s in subs for e in plan[s][half:]])

    # the moved subscriptions' new partitions are consumed first, their old ones 3 s later
    new_parts = sorted({after[s] for s in moved})
    old_parts = sorted(set(range(P)) - set(new_parts)) or [before[next(iter(moved))]]
    new_parts = [i for i in new_parts if i not in old_parts]
    assert new_parts and old_parts, (new_parts, old_parts)
    relay_daemons(["--poll-interval", "50ms"], wait_ready=True)  # receipt.requested follow-ups
    procs = [group_consumers("billing", q, db, args + ["--partition", str(i)], label=f"new{i}")
             for i in new_parts]
    time.sleep(3)
    procs += [group_consumers("billing", q, db, args + ["--partition", str(i)], label=f"old{i}")
              for i in old_parts]

    n_paid = sum(1 for evs in plan.values() for e in evs if e.type == "invoice.paid")
    want = SUBS * PER_SUB + n_paid  # events, and the receipt.requested of each paid invoice
    wait_until(lambda: db.scalar("SELECT count(*) FROM consumed_events WHERE consumer = "
                                 "'billing'") >= want, 60, 0.2, f"{want} ledger rows")
    summary = audit(db.query, plan)
    print(f"\n{len(moved)} of {SUBS} subscriptions moved; {summary}")

    # every subscription that moved and had events on both sides waited for a fence
    logs = "\n".join(p.log() for p in procs)
    fenced = {s for s in moved if f"subscription {s} moved from partition {before[s]} to "
              f"{after[s]}" in logs}
    crossing = {s for s in moved if plan[s][1:half] and plan[s][half:]}
    assert fenced == crossing, (f"{len(crossing - fenced)} moved subscriptions were not held, "
                                f"e.g. {sorted(crossing - fenced)[:3]}")
    # a fence nobody waits for any more (its event went once another event of the subscription
    # had moved the route) is left for the day-old cleanup; every fence belongs to a held event
    # that was applied
    waiter = {}
    for line in logs.splitlines():
        if "(fence " in line and "event_id=" in line:
            waiter[line.split("(fence ")[1].split(")")[0]] = line.split("event_id=")[1].split()[0]
    ledger = {r[0] for r in db.query("SELECT event_id::text FROM consumed_events")}
    left = [r[0] for r in db.query("SELECT fence_id::text FROM idem_partition_fences")]
    assert all(f in waiter and waiter[f] in ledger for f in left), left
    print(f"{len(waiter)} fences, {len(left)} left for the cleanup")
    routes = dict(db.query("SELECT subscription_id::text, partition FROM idem_partition_routes "
                           "WHERE consumer = 'billing'"))
    assert {s: routes[s] for s in subs} == {s: after[s] for s in subs}
    for p in procs:
        assert p.stop() == 0, p.log()
