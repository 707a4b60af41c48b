"""Two consumer processes on one plain queue: one active, one standing by, order kept through
SIGKILLs of the active one.

Two `idem consume --consumer billing --queue Q` processes (the default topology, --partitions 1)
share Q while `idem relay` publishes 120 subscriptions' payment.failed / invoice.paid sequences
emitted through idem_emit; about every second the process that is applying events is SIGKILLed
and started again. Contract ("Order and scale-out"): Q has x-single-active-consumer, so one
process is active and the other stands by; when the active one dies the broker returns its
unacknowledged deliveries and the standby takes over from them. Afterwards every event is
applied once, each subscription's effects are in emit order, its final dunning step the one of
applying its events in order (audit of group_helpers); nothing is dead-lettered.

Without single active consumer both processes would be fed at once and apply one subscription's
events concurrently and out of order."""

import json
import time

import pytest

from conftest import wait_until
from group_helpers import (Emitter, active_consumers, audit, group_consumers, group_queue,
                           install_effect_log, plan_billing)
from relay_helpers import relay_daemons

__all__ = ["group_consumers", "group_queue", "relay_daemons"]

SUBS = 120
PER_SUB = 10
RATE = 200.0  # events/s: 1,200 events in about 6 s
KILL_EVERY = 1.0


@pytest.mark.slow  # three SIGKILLs, each waiting for the standby to take over: 1-2 minutes
def test_two_processes_on_a_plain_queue_keep_order_through_sigkills(
        db, servers, broker, group_queue, group_consumers, relay_daemons):
    q = group_queue("standby")
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=21)
    procs = [group_consumers("billing", q, db, label=f"c{i}") for i in range(2)]
    relay_daemons(["--poll-interval", "50ms"], wait_ready=True)
    args = {x["name"]: x for x in json.loads(
        servers.rmqctl("-q", "list_queues", "name", "arguments", "--formatter", "json"))}
    assert ["x-single-active-consumer", "bool", True] in args[q]["arguments"], args[q]
    active = active_consumers(servers.rmqctl, [q], procs)
    assert active[q] in ("c0", "c1"), active
    listed = servers.rmqctl("-q", "list_consumers", "queue_name", "--formatter", "json")
    assert sum(c["queue_name"] == q for c in json.loads(listed)) == 2, listed

    emitter = Emitter(db.url, order, rate=RATE, per_tx=5)
    emitter.start()
    kills = []
    last = {p.name: p.applied() for p in procs}
    next_kill = time.monotonic() + KILL_EVERY
    while emitter.is_alive() and len(kills) < 20:
        time.sleep(max(0.0, next_kill - time.monotonic()))
        next_kill = time.monotonic() + KILL_EVERY
        now = {p.name: p.applied() for p in procs}
        gained = {n: (now[n] or 0) - (last[n] or 0) for n in now if now[n] is not None}
        last = now
        both = [n for n, g in gained.items() if g > 0]
        victim_name = max(gained, key=gained.get, default=None)
        if victim_name is None or gained[victim_name] <= 0:
            continue
        victim = next(p for p in procs if p.name == victim_name)
        victim.sigkill()
        kills.append((victim.name, len(both)))
        victim.start()  # back as the standby
        last[victim.name] = victim.applied()
    emitter.finish()
    assert len(kills) >= 3, f"only {len(kills)} SIGKILLs during the load"

    total = len(order) + sum(e.type == "invoice.paid" for e in order)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 120, 0.2,
               lambda: f"{total} ledger rows (have "
               f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')})")
    for p in procs:
        assert p.running(), f"{p.name} exited:\n{p.log()[-3000:]}"
    summary = audit(db.query, plan)
    assert summary["ledger_rows"] == total
    assert broker.queue_info(q)[0] == 0
    assert broker.depth(q + ".dlq") == 0, broker.get_all(q + ".dlq")[:3]
    print(f"\nSIGKILLs of the active process: {len(kills)}; {summary['events']} events + "
          f"{summary['paid']} receipts applied once in order")
