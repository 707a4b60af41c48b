"""Losing the RabbitMQ node that leads the queues loses nothing and applies nothing twice.

A 3-node cluster; two relays and a small partitioned group (P = 2, two consumer processes) are
given the URL list of every node (`--amqp "url1,url2,url3"`). Under a steady load of billing
events the node leading the partitions is stopped. The daemons connected to it log the lost
connection and connect to another node of the list; every event emitted is applied exactly once,
each subscription's effects stay in emit order, nothing is dead-lettered. The node is started
again at the end. The longest pause in effects and the drain time are printed.

Without the URL list the daemons would retry the dead node for as long as it is down; without
quorum queues or confirms, messages held or in flight on that node would be lost; without the
ledger, the redeliveries and republishes that follow the lost connections would apply twice."""

import time

import pika
import pytest

from conftest import finish_daemons, wait_until
from group_helpers import (Emitter, GroupConsumer, Endpoints, audit, install_effect_log,
                           partitions, plan_billing)
from ha_helpers import instance_fixture
from relay_helpers import RelayDaemon, status_counts

pytestmark = pytest.mark.cluster

cluster = instance_fixture("--rmq-nodes", "3")

P = 2
SUBS = 60
PER_SUB = 10
RATE = 100.0  # events/s: 600 events in about 6 s


def queue_depth(url, queue):
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 5
    conn = pika.BlockingConnection(params)
    try:
        return conn.channel().queue_declare(queue=queue, passive=True).method.message_count
    finally:
        conn.close()


def test_node_loss_under_load(db, cluster, broker, tmp_path, request):
    urls = cluster.amqp_urls
    ep = Endpoints(urls)
    q = f"it.grp.nodeloss.{int(time.time() * 1000) % 10**8}"
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=11)
    daemons = []
    request.addfinalizer(lambda: finish_daemons(daemons, request))

    args = ["--partitions", str(P), "--heartbeat", "5s"]
    cons = []
    for i in range(2):
        c = GroupConsumer("billing", q, db, ep, broker, str(tmp_path), args, None, None, True)
        c.name = f"consumer{i + 1}"
        daemons.append(c)
        cons.append(c.start())
    relays = []
    for i in range(2):
        r = RelayDaemon(db, ep, str(tmp_path), ["--poll-interval", "50ms", "--heartbeat", "5s"],
                        name=f"relay{i + 1}")
        daemons.append(r)
        relays.append(r.start(wait_ready=True))

    leaders = {name: cluster.leader(name) for name in partitions(q, P)}
    victim = leaders[q + ".p0"]
    victim_port = urls.split(",")[victim - 1].rsplit(":", 1)[1]
    on_victim = [d.name for d in cons + relays
                 if f"server=127.0.0.1:{victim_port}" in d.log()]
    assert on_victim, (f"no daemon is connected to node {victim}, the leader of {q}.p0 "
                       f"(leaders {leaders}): the test would not move anyone")

    emitter = Emitter(db.url, order, rate=RATE, per_tx=2)
    emitter.start()
    wait_until(lambda: emitter.progress >= len(order) // 3, 30, 0.05, "a third of the load")
    t_stop = time.time()
    try:
        cluster.rmq_stop(victim)
        t_stopped = time.time()
        emitter.finish()
        t_load_end = emitter.done_at
        total = len(order) + sum(e.type == "invoice.paid" for e in order)
        wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 180,
                   0.2, lambda: f"{total} ledger rows (have "
                   f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')}; outbox "
                   f"{status_counts(db)}); last lines of the daemons' logs:\n"
                   + "\n".join(d.log().splitlines()[-1][:400] for d in cons + relays))
        t_drained = time.time()
        for d in cons + relays:
            assert d.running(), f"{d.name} exited:\n{d.log()[-3000:]}"

        audit(db.query, plan)
        assert db.count("idem.event_outbox", "status <> 'sent'") == 0
        alive_url = urls.split(",")[(victim % 3)]
        assert queue_depth(alive_url, q + ".dlq") == 0
        for name in partitions(q, P):
            assert queue_depth(alive_url, name) == 0, name

        moved = {}
        for d in cons + relays:
            if d.name not in on_victim:
                continue
            log = d.log()
            assert "RabbitMQ connection dropped" in log, f"{d.name} logged no lost connection"
            after = log[log.index("RabbitMQ connection dropped"):]
            servers_after = {w.split("=", 1)[1] for line in after.splitlines()
                             if "connected to RabbitMQ" in line
                             for w in line.split() if w.startswith("server=")}
            assert servers_after and f"127.0.0.1:{victim_port}" not in servers_after, \
                f"{d.name} reconnected to {servers_after}"
            moved[d.name] = sorted(servers_after)
        for c in cons:
            if c.name in on_victim:
                assert c.metric("idem_reconnects_total", server="rabbitmq") >= 1

        nacks = sum(r.log().count("the broker nacked the publish") for r in relays)
        ats = [r[0] for r in db.query("SELECT extract(epoch FROM at)::float8 FROM it_effects "
                                      "ORDER BY at")]
        window = [a for a in ats if a >= t_stop - 1]
        gaps = [(b - a, a) for a, b in zip(window, window[1:]) if a <= t_load_end]
        pause, pause_at = max(gaps) if gaps else (0.0, t_stop)
        print(f"\nnode {victim} (leader of {sorted(leaders.items())}) stopped "
              f"{t_stopped - t_stop:.1f} s after the stop began; moved: {moved}; longest pause "
              f"in effects {pause * 1000:.0f} ms starting {pause_at - t_stop:+.1f} s from the "
              f"stop; drained {t_drained - t_load_end:.1f} s after the load ended "
              f"({t_drained - t_stop:.1f} s after the stop began); {nacks} publishes nacked "
              f"and retried; "
              f"{len(order)} events applied once in order")
    finally:
        cluster.rmq_start(victim)
    assert cluster.running_nodes() == [1, 2, 3]
