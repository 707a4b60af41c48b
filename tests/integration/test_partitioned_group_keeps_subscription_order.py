"""A partitioned consumer group keeps each subscription's order while its active processes die.

Six `idem consume --consumer billing --queue Q --partitions 4` processes (each consuming all four
partitions; the broker makes one consumer of each partition active, the others wait) apply 200
subscriptions' payment.failed / invoice.paid sequences, emitted through idem_emit in a known
order and published by `idem relay`, while about every second the process that is applying
events is SIGKILLed and started again. Afterwards:

- every event, and the receipt.requested of each paid invoice, has exactly one ledger row;
- each subscription's effects (dunning changes and revenue entries, logged by triggers in the
  order they happened) are its events in emit order, each event's once, and its final dunning
  step is the one of applying its events one by one;
- one revenue entry and one receipt per paid invoice; nothing dead-lettered.

Without the partitioned topology (several processes on one plain queue) two processes would apply
one subscription's events concurrently and out of order; without single active consumers, or if
a takeover redelivered a dead process's unacked events behind later ones, dunning would end on
the wrong step. The takeover time (SIGKILL to the next process's first effect on the partitions
the dead one held) is printed."""

import statistics
import time

import pytest

from conftest import wait_until
from group_helpers import (Emitter, active_consumers, audit, group_consumers, group_queue,
                           install_effect_log, partition_of, partitions, plan_billing,
                           takeover_seconds)
from relay_helpers import relay_daemons

__all__ = ["group_consumers", "group_queue", "relay_daemons"]

P = 4
PROCESSES = 6
SUBS = 200
PER_SUB = 8
RATE = 200.0  # events/s: 1,600 events in about 8 s
KILL_EVERY = 1.0


@pytest.mark.slow
def test_partitioned_group_keeps_subscription_order_through_sigkills(
        db, servers, broker, group_queue, group_consumers, relay_daemons):
    q = group_queue("order")
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=4)
    args = ["--partitions", str(P)]

    # Declare the group's topology; each subscription's partition follows from its id.
    first = group_consumers("billing", q, db, args, label="c0")
    assert first.stop() == 0
    where = partition_of(list(plan), P)
    subs_by_partition = {i: [s for s, p in where.items() if p == i] for i in range(P)}
    assert all(subs_by_partition.values()), f"a partition got no subscription: {where}"

    procs = [first.start()] + [group_consumers("billing", q, db, args, label=f"c{i}")
                               for i in range(1, PROCESSES)]
    relay_daemons(["--poll-interval", "50ms"], wait_ready=True)
    active = active_consumers(servers.rmqctl, partitions(q, P), procs)
    print(f"\nactive consumer per partition at start: {active}")
    assert all(v not in (None, "?") for v in active.values()), active

    emitter = Emitter(db.url, order, rate=RATE, per_tx=5)
    emitter.start()
    kills = []  # (epoch seconds, process)
    last = {p.name: p.applied() for p in procs}
    next_kill = time.monotonic() + KILL_EVERY
    while emitter.is_alive() and len(kills) < 30:
        time.sleep(max(0.0, next_kill - time.monotonic()))
        next_kill = time.monotonic() + KILL_EVERY
        now = {p.name: p.applied() for p in procs}
        gained = {n: (now[n] or 0) - (last[n] or 0) for n in now if now[n] is not None}
        last = now
        victim_name = max(gained, key=gained.get, default=None)
        if victim_name is None or gained[victim_name] <= 0:
            continue  # nobody applied anything in the last second: nothing to take over
        victim = next(p for p in procs if p.name == victim_name)
        kill_at = time.time()
        victim.sigkill()
        kills.append((kill_at, victim.name))
        # joins the group again, as a waiting consumer (not waited for: binding the group's 1024
        # shard keys takes it seconds, while the others take over)
        victim.start(wait_ready=False)
        last[victim.name] = victim.applied()
    emitter.finish()
    assert len(kills) >= 5, f"only {len(kills)} SIGKILLs during the load"

    total = len(order) + sum(e.type == "invoice.paid" for e in order)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 120, 0.2,
               lambda: f"{total} ledger rows (have "
               f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')})")
    for p in procs:
        assert p.running(), f"{p.name} exited:\n{p.log()[-3000:]}"

    summary = audit(db.query, plan)
    assert summary["ledger_rows"] == total
    assert db.count("idem.event_outbox", "status <> 'sent'") == 0
    for name in partitions(q, P):
        assert broker.queue_info(name)[0] == 0, f"{name} still holds messages"
    assert broker.depth(q + ".dlq") == 0, broker.get_all(q + ".dlq")[:3]

    takeovers = []
    for kill_at, name in kills:
        gaps = takeover_seconds(db.query, kill_at, subs_by_partition)
        if all(g is not None for g in gaps.values()):
            takeovers.append(max(gaps.values()))
    assert takeovers, "no takeover measured"
    print(f"SIGKILLs of the active process: {len(kills)} "
          f"({', '.join(sorted({n for _, n in kills}))}); takeover (SIGKILL to the next "
          f"process's first effect on the dead one's partitions): median "
          f"{statistics.median(takeovers) * 1000:.0f} ms, max {max(takeovers) * 1000:.0f} ms "
          f"over {len(takeovers)}; {summary['events']} events + {summary['paid']} receipts "
          f"applied once in order")
