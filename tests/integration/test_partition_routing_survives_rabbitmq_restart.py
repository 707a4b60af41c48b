"""A subscription stays on its partition when RabbitMQ restarts.

RabbitMQ 3.10's consistent-hash exchange numbers its hash buckets in the order the bindings were
added, and at boot rebuilds that numbering from the stored bindings sorted by queue name. A group
whose partitions were bound in any other order (p1 before p0, or p2 before p10) would route every
subscription to a different partition after a restart: its next events would be applied from
another queue, ahead of the earlier ones still waiting in the old one. idem binds the partitions
in the order the broker sorts them, so the routing before and after a restart is the same.

Twelve partitions, so that the byte order of the names (p0, p1, p10, p11, p2, ...) differs from
the numeric one; 400 subscriptions probed before and after."""

import uuid

from group_helpers import group_consumers, group_queue, partition_of

__all__ = ["group_consumers", "group_queue"]

P = 12


def test_partition_routing_survives_rabbitmq_restart(servers, db, group_queue, group_consumers):
    q = group_queue("restart")
    subs = [str(uuid.uuid4()) for _ in range(400)]
    c = group_consumers("billing", q, db, ["--partitions", str(P)])
    assert c.stop() == 0, c.log()

    before = partition_of(servers.amqp_url, q, P, subs)
    used = set(before.values())
    assert len(used) == P, f"only partitions {sorted(used)} got a subscription"

    servers.rmq_stop()
    servers.rmq_start()

    after = partition_of(servers.amqp_url, q, P, subs)
    moved = {s: (before[s], after[s]) for s in subs if before[s] != after[s]}
    assert not moved, (f"{len(moved)} of {len(subs)} subscriptions changed partition across a "
                       f"RabbitMQ restart, e.g. {list(moved.items())[:3]}")

    # a process starting again on the restarted broker binds nothing new: the routing holds
    c.start()
    assert c.stop() == 0, c.log()
    again = partition_of(servers.amqp_url, q, P, subs)
    assert again == before
