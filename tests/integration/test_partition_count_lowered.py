"""A group whose partition count was lowered: subscriptions last applied from a partition that no
longer exists (an earlier group of four, now two) are not held for a fence nobody can reach. The
consumer records such a fence itself, in its own statement, while its batches commit on its two
connections; each event then applies once, in order, and the routes point to the new
partitions."""

from conftest import new_id, payload, wait_until
from group_helpers import group_consumers, group_queue

__all__ = ["group_consumers", "group_queue"]

P = 2
SUBS = 200
PER_SUB = 6


def test_routes_to_a_partition_that_no_longer_exists(db, broker, group_queue, group_consumers):
    q = group_queue("lower")
    args = ["--partitions", str(P)]
    declare = group_consumers("billing", q, db, args, label="declare")
    assert declare.stop() == 0
    subs = [new_id() for _ in range(SUBS)]
    for s in subs:  # last applied from partition 3 of an earlier, larger group
        db.execute("INSERT INTO idem_partition_routes (consumer, subscription_id, partition)"
                   " VALUES ('billing', %s, 3)", s)
    for k in range(PER_SUB):
        for s in subs:
            broker.publish_event("payment.failed", payload(subscription_id=s, n=k),
                                 headers={"subscription_id": s})

    procs = [group_consumers("billing", q, db, args + ["--partition", str(i)], label=f"p{i}")
             for i in range(P)]
    want = SUBS * PER_SUB
    wait_until(lambda: db.count("consumed_events") == want or None, 30, 0.2,
               lambda: f"{want} ledger rows (now {db.count('consumed_events')})")
    for c in procs:
        assert c.stop() == 0
    for s in subs:
        assert db.dunning_step(s) == PER_SUB, s
    routes = dict(db.query("SELECT subscription_id::text, partition FROM idem_partition_routes "
                           "WHERE consumer = 'billing'"))
    assert all(routes[s] in range(P) for s in subs), routes
    assert broker.depth(q + ".p0") == 0 and broker.depth(q + ".p1") == 0
