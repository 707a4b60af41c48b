"""The partitioned topology is the contract's ("Order and scale-out"), so that every process of a
group, on any machine, and operators' tooling agree on it:

- `--partitions 4`: a durable direct exchange Q.part (alternate exchange Q.part.unkeyed, a
  fanout bound to Q.p0) bound to the main exchange with the binding keys; durable quorum queues
  Q.p0..Q.p3 with x-single-active-consumer, partition i bound to Q.part with the shard keys
  idem.shard.N for N mod 4 = i, dead-lettering to Q.dlq through Q.dlx; no queue Q, no Q.hash.
  Without single active consumers two processes would apply one subscription's events at once;
  without the shard keys its events would spread over partitions and lose their order.
- Events of one subscription always land, once, in the partition its shard names, in emit
  order; the relay's BCC header is gone when they arrive; a queue bound `#` on the main exchange
  still gets one copy; a message without a shard key (a foreign publisher) lands once in Q.p0.
- A process whose --partitions differs from the declared group exits 1 with one line (else two
  topologies would split one subscription's events between processes).
- `--partition 1,3` consumes those partitions only (else a process meant for some partitions would
  take over others).
- No RabbitMQ plugin is needed: --partitions 2 runs on a broker without the consistent-hash
  plugin.
- `--partitions 1` (the default) keeps the single queue Q, bound directly to the main exchange,
  with x-single-active-consumer too."""

import contextlib
import json
import os
import subprocess
import time

import pytest

from conftest import EXCHANGE, IDEM, Broker, new_id, payload, wait_until
from group_helpers import (BILLING_TYPES, group_consumers, group_queue, partition_of,
                           partitions, shard)
from ha_helpers import instance
from relay_helpers import emit_many, read_queue, relay_once

__all__ = ["group_consumers", "group_queue"]

P = 4


def rabbit(servers, *args):
    """rabbitmqctl ARGS --formatter json, parsed; argument tables become dicts."""
    rows = json.loads(servers.rmqctl("-q", *args, "--formatter", "json") or "[]")
    for r in rows:
        if isinstance(r.get("arguments"), list):
            r["arguments"] = {a[0]: a[2] for a in r["arguments"]}
    return rows


def consume_exit(db, servers, queue, *args, amqp_url=None, consuming=None, wait=20):
    """Runs `idem consume --log-level warn --consumer billing --queue QUEUE ARGS`, expecting it to
    exit by itself; returns (status, stderr). status is None when it was found consuming instead
    (consuming: a queue whose consumer count tells) or still running after wait s."""
    e = dict(os.environ, IDEM_PG_URL=db.url, IDEM_AMQP_URL=amqp_url or servers.amqp_url)
    e.pop("IDEM_FAULT", None)
    p = subprocess.Popen([IDEM, "consume", "--log-level", "warn", "--consumer", "billing",
                          "--queue", queue, *args], env=e, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    broker = Broker(amqp_url or servers.amqp_url)
    try:
        def settled():
            if p.poll() is not None:
                return True
            info = broker.queue_info(consuming) if consuming else None
            return bool(info and info[1] >= 1)

        with contextlib.suppress(AssertionError):
            wait_until(settled, wait, 0.1)
    finally:
        if p.poll() is None:
            p.kill()
        _, err = p.communicate()
    return (None if p.returncode < 0 else p.returncode), err


def declare_group(group_consumers, db, q, p):
    """Starts one consumer of the group (it declares the topology) and stops it."""
    c = group_consumers("billing", q, db, ["--partitions", str(p)])
    assert c.stop() == 0, c.log()


@pytest.mark.slow
def test_partitioned_topology_is_the_contracts(db, servers, group_queue, group_consumers):
    q = group_queue("topo")
    c = group_consumers("billing", q, db, ["--partitions", str(P)])

    xs = {x["name"]: x for x in rabbit(servers, "list_exchanges", "name", "type", "durable",
                                        "arguments")}
    assert q + ".hash" not in xs
    assert xs[q + ".part"]["type"] == "direct" and xs[q + ".part"]["durable"] is True
    assert xs[q + ".part"]["arguments"] == {"alternate-exchange": q + ".part.unkeyed"}
    assert xs[q + ".part.unkeyed"]["type"] == "fanout"
    assert xs[q + ".part.unkeyed"]["durable"] is True
    assert xs[q + ".dlx"]["type"] == "direct" and xs[q + ".dlx"]["durable"] is True

    qs = {x["name"]: x for x in rabbit(servers, "list_queues", "name", "durable", "type",
                                        "arguments")}
    assert q not in qs, "a partitioned group must not declare the plain queue"
    assert q + f".p{P}" not in qs
    for name in partitions(q, P):
        assert qs[name]["type"] == "quorum" and qs[name]["durable"] is True, qs[name]
        args = qs[name]["arguments"]
        assert args.get("x-single-active-consumer") is True, args
        assert args.get("x-dead-letter-exchange") == q + ".dlx", args
        assert args.get("x-dead-letter-routing-key") == q + ".dlq", args
    assert qs[q + ".dlq"]["durable"] is True

    binds = rabbit(servers, "list_bindings", "source_name", "source_kind", "destination_name",
                   "destination_kind", "routing_key")
    ours = [(b["source_name"], b["destination_name"], b["destination_kind"], b["routing_key"])
            for b in binds if b["source_name"] and (b["destination_name"].startswith(q)
                                                    or b["source_name"].startswith(q))]
    want = {(EXCHANGE, q + ".part", "exchange", t) for t in BILLING_TYPES}
    want |= {(q + ".part", f"{q}.p{n % P}", "queue", f"idem.shard.{n}") for n in range(1024)}
    want |= {(q + ".part.unkeyed", q + ".p0", "queue", "")}
    want |= {(q + ".dlx", q + ".dlq", "queue", q + ".dlq")}
    assert set(ours) == want and len(ours) == len(want), sorted(set(ours) ^ want)[:10]

    # the process consumes every partition
    for name in partitions(q, P):
        assert c.broker.queue_info(name)[1] == 1, name


def test_one_subscription_always_lands_in_the_same_partition(db, servers, broker, group_queue,
                                                             group_consumers):
    q = group_queue("land")
    declare_group(group_consumers, db, q, P)
    # a queue of another consumer bound to everything: one copy of each event, BCC or not
    tap = q + ".tap"
    with broker.channel() as ch:
        ch.queue_declare(tap, durable=True, arguments={"x-queue-type": "quorum"})
        ch.queue_bind(tap, EXCHANGE, routing_key="#")
    try:
        subs = [f"00000000-0000-4000-8000-{i:012x}" for i in range(40)]
        events = [("payment.failed", s, f"{s}:{n}", payload(subscription_id=s, n=n))
                  for n in range(5) for s in subs]
        emit_many(db, events)
        r = relay_once(db, servers)
        assert r.returncode == 0, r.stderr
        assert db.count("idem.event_outbox", "status = 'sent'") == len(events)

        home = {}
        total = 0
        for i, name in enumerate(partitions(q, P)):
            got = read_queue(broker, name, idle=0.5, timeout=5)
            total += len(got)
            seqs = {}
            for m in got:
                assert "BCC" not in m.headers, m.headers
                assert home.setdefault(m.sub, i) == i, f"{m.sub} in partitions {home[m.sub]}, {i}"
                seqs.setdefault(m.sub, []).append((m.headers["x-idem-seq"], m.n))
            for s, pairs in seqs.items():
                assert [n for _, n in pairs] == list(range(5)), f"{s} in {name}: {pairs}"
                assert [x for x, _ in pairs] == sorted(x for x, _ in pairs)
        assert total == len(events), f"{total} deliveries for {len(events)} events"
        assert sorted(home) == sorted(subs), "some events reached no partition"
        assert set(home.values()) == set(range(P)), f"a partition got nothing: {home}"
        # where the contract's shard says, which no broker state can change
        assert home == partition_of(subs, P)
        assert shard(subs[0].upper()) == shard(subs[0])
        tapped = read_queue(broker, tap, idle=0.5, timeout=5)
        assert len(tapped) == len(events), f"the # queue got {len(tapped)} of {len(events)}"
        assert all("BCC" not in m.headers for m in tapped)

        # a foreign publisher's message carries no shard key: once, in p0
        broker.publish_event("payment.failed", payload(subscription_id=subs[0]))
        assert len(read_queue(broker, q + ".p0", idle=0.5, timeout=5)) == 1
        for name in partitions(q, P)[1:]:
            assert broker.depth(name) == 0, name
    finally:
        broker.delete_queue(tap)


@pytest.mark.slow
@pytest.mark.parametrize("declared, asked", [(4, 2), (2, 4)])
def test_a_different_partition_count_exits_1_with_one_line(db, servers, group_queue,
                                                           group_consumers, declared, asked):
    q = group_queue(f"count{declared}{asked}")
    declare_group(group_consumers, db, q, declared)
    status, err = consume_exit(db, servers, q, "--partitions", str(asked))
    assert status == 1, f"exit {status}, stderr: {err!r}"
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("idem consume: ") and q in lines[0] and "--partitions" in lines[0]
    # nothing of the other count was declared
    qs = {x["name"] for x in rabbit(servers, "list_queues", "name")}
    assert {n for n in qs if n.startswith(q + ".p")} == set(partitions(q, declared))


def test_partitions_1_on_a_partitioned_group_exits_1_with_one_line(db, servers, group_queue,
                                                                  group_consumers):
    """The default --partitions 1 finding Q.p0..Q.p3 is also a different P."""
    q = group_queue("count41")
    declare_group(group_consumers, db, q, P)
    status, err = consume_exit(db, servers, q, "--partitions", "1", consuming=q)
    qs = {x["name"] for x in rabbit(servers, "list_queues", "name")}
    assert status == 1, (f"--partitions 1 with {P} partitions declared: exit {status} (None: "
                         f"it runs and consumes), stderr {err!r}; queues now {sorted(n for n in qs if n.startswith(q))}")
    assert len(err.splitlines()) == 1, err
    assert q not in qs


def test_partitions_on_a_plain_queue_exits_1_with_one_line(db, servers, group_queue,
                                                          group_consumers):
    """A group declared with P = 1 (the queue Q) and a process asking for P = 4."""
    q = group_queue("count14")
    declare_group(group_consumers, db, q, 1)
    status, err = consume_exit(db, servers, q, "--partitions", str(P), consuming=q + ".p0")
    qs = {x["name"] for x in rabbit(servers, "list_queues", "name")}
    assert status == 1, (f"--partitions {P} with the plain queue declared: exit {status} (None: "
                         f"it runs and consumes), stderr {err!r}; queues now {sorted(n for n in qs if n.startswith(q))}")
    assert len(err.splitlines()) == 1, err


def test_partition_list_consumes_only_those(db, servers, broker, group_queue, group_consumers):
    q = group_queue("list")
    declare_group(group_consumers, db, q, P)
    subs = [f"00000000-0000-4000-8000-{i:012x}" for i in range(40)]
    where = partition_of(subs, P)
    c = group_consumers("billing", q, db, ["--partitions", str(P), "--partition", "1,3"])
    assert "consuming 2 queues" in c.log()
    assert [broker.queue_info(n)[1] for n in partitions(q, P)] == [0, 1, 0, 1]

    # as the relay publishes them: the shard key in BCC
    ids = {s: broker.publish_event("payment.failed", payload(subscription_id=s),
                                   headers={"subscription_id": s,
                                            "BCC": [f"idem.shard.{shard(s)}"]}) for s in subs}
    mine = [s for s in subs if where[s] in (1, 3)]
    others = [s for s in subs if where[s] in (0, 2)]
    assert mine and others
    wait_until(lambda: db.count("idem.consumed_events") >= len(mine), 20, 0.1,
               lambda: f"{len(mine)} events of partitions 1 and 3 applied")
    time.sleep(0.5)
    applied = {r[0] for r in db.query("SELECT event_id::text FROM idem.consumed_events")}
    assert applied == {ids[s] for s in mine}
    left = broker.queue_info(q + ".p0")[0] + broker.queue_info(q + ".p2")[0]
    assert left == len(others)


def test_partitions_1_keeps_the_single_queue(db, servers, broker, group_queue, group_consumers):
    q = group_queue("single")
    c = group_consumers("billing", q, db, ["--partitions", "1"])
    qs = {x["name"]: x for x in rabbit(servers, "list_queues", "name", "type", "arguments")}
    assert qs[q]["type"] == "quorum"
    assert qs[q]["arguments"].get("x-single-active-consumer") is True, qs[q]["arguments"]
    assert not [n for n in qs if n.startswith(q + ".p")]
    xs = {x["name"] for x in rabbit(servers, "list_exchanges", "name")}
    assert q + ".hash" not in xs and q + ".part" not in xs
    binds = {(b["source_name"], b["routing_key"]) for b in rabbit(
        servers, "list_bindings", "source_name", "destination_name", "routing_key")
        if b["destination_name"] == q and b["source_name"]}
    assert binds == {(EXCHANGE, t) for t in BILLING_TYPES}
    assert broker.queue_info(q)[1] == 1
    sub = new_id()
    broker.publish_event("payment.failed", payload(subscription_id=sub))
    wait_until(lambda: db.dunning_step(sub) == 1, 15, 0.1, "the event applied")
    assert c.stop() == 0


@pytest.mark.cluster
def test_partitions_need_no_plugin(db, servers):
    """Starts a RabbitMQ of its own without the consistent-hash plugin (marked cluster: servers
    of its own)."""
    with instance("--no-hash-plugin") as inst:
        assert inst.env["IDEM_RMQ_HASH_PLUGIN"] == "0"
        q = f"it.grp.noplugin.{new_id()[:8]}"
        status, err = consume_exit(db, servers, q, "--partitions", "2",
                                   amqp_url=inst.amqp_url(1), consuming=q + ".p0")
        assert status is None, f"--partitions 2 without the plugin exited {status}: {err!r}"
