"""Least privilege on RabbitMQ: each component runs as a RabbitMQ user holding only the
configure / write / read permissions of README's "RabbitMQ permissions per component" (the same
regular expressions as `permissions()` below), and the broker refuses (403 ACCESS_REFUSED) what
that component must not do.

- relay: publishes to billing.events; with --no-declare it needs no configure permission at all,
  and exits 1 with one line when the exchange it would use is missing.
- consumer of QUEUE: declares and consumes its own topology, dead-letters through QUEUE.dlx with
  no write permission on the default exchange or on QUEUE.dlq; cannot publish events, nor read
  another consumer's queue. Partitioned (--partitions 2) likewise with QUEUE.part,
  QUEUE.part.unkeyed and QUEUE.p<N>.
- consumer with --no-declare: no configure permission; runs (and dead-letters) when the topology
  exists, exits 1 with one line naming what is missing when it does not; without --no-declare
  the same user is refused by the broker.
- operator (dlq list / requeue for QUEUE): reads QUEUE.dlq, writes the default exchange; cannot
  read the live queue nor publish events; without the write permission a requeue fails and
  leaves the dead letter where it was.

Without this, any leaked credential of one component could forge billing events, drain another
consumer's queue or rebuild the topology, and an operator could not grant less than everything.
"""

import json
import re
import uuid

import pika
import pytest

from conftest import EXCHANGE, new_id, payload, run_idem, wait_until
from relay_helpers import declare_consumer_queue, emit, read_queue

NONE = "^$"


def permissions(component, queue=None, partitions=1, no_declare=False):
    """(configure, write, read) regular expressions for component on vhost "/" (README)."""
    ex = re.escape(EXCHANGE)
    q = re.escape(queue) if queue else None
    if component == "relay":
        return (NONE if no_declare else f"^{ex}$", f"^{ex}$", NONE)
    if component == "consumer":
        own = [q] if partitions == 1 else [rf"{q}\.p[0-9]+"]
        if no_declare:  # consume its queues, publish dead letters to QUEUE.dlx
            return (NONE, rf"^{q}\.dlx$", "^(" + "|".join(own) + ")$")
        if partitions > 1:
            own.append(rf"{q}\.part(\.unkeyed)?")
        configure = [ex, *own, rf"{q}\.dlq", rf"{q}\.dlx"]
        write = [*own, rf"{q}\.dlq", rf"{q}\.dlx"]
        read = [ex, *own, rf"{q}\.dlx"]
        return tuple("^(" + "|".join(x) + ")$" for x in (configure, write, read))
    if component == "operator":  # dlq list / requeue for one queue
        target = r"amq\.default" if partitions == 1 else rf"{q}\.part"
        return (NONE, f"^{target}$", rf"^{q}\.dlq$")
    raise ValueError(component)


def refused(url, what, action):
    """Runs action(channel) as the user of url; asserts the broker refuses it with 403."""
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 5
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            action(ch)
        assert e.value.reply_code == 403, (what, e.value)
        assert "ACCESS_REFUSED" in e.value.reply_text, (what, e.value)
    finally:
        try:
            conn.close()
        except Exception:
            pass


def publish(exchange, key):
    def action(ch):
        ch.confirm_delivery()
        ch.basic_publish(exchange, key, b"{}", pika.BasicProperties(message_id=new_id()))
    return action


def get(queue):
    return lambda ch: ch.basic_get(queue, auto_ack=False)


def declare_queue(queue):
    return lambda ch: ch.queue_declare(queue, durable=True)


INFO_LOG = re.compile(r"^\S+Z (info|debug) ")


def one_line(r, cmd):
    """The one line saying why idem CMD failed (a daemon's info lines aside)."""
    lines = [line for line in r.stderr.splitlines() if line.strip() and not INFO_LOG.match(line)]
    assert len(lines) == 1, f"idem {cmd}: expected one line:\n{r.stderr}"
    assert lines[0].startswith(f"idem {cmd}: "), lines[0]
    return lines[0]


def last_line(r, cmd):
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"idem {cmd}: "), r.stderr
    return lines[-1]


def malformed(broker):
    """A delivery the consumer must dead-letter (malformed_json); returns its id."""
    eid = new_id()
    broker.publish_raw(b"{not json", routing_key="payment.failed", message_id=eid,
                       type="payment.failed")
    return eid


# ----------------------------------------------------------------------------- relay


def test_relay_publishes_with_its_permissions(db, servers, broker, queues, rmq_user):
    q = queues.new()
    declare_consumer_queue(broker, q, ["payment.failed"])
    url = rmq_user("relay", permissions("relay"))
    body = payload()
    eid = emit(db, "payment.failed", body["subscription_id"], "lp-" + new_id(), body)
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=url)
    assert r.returncode == 0, r.stderr
    assert db.count("idem.event_outbox", "status = 'sent'") == 1
    assert [m.event_id for m in read_queue(broker, q, expect=1)] == [eid]
    # what the relay's user must not do
    refused(url, "relay reads a queue", get(q))
    refused(url, "relay declares a queue", declare_queue(queues.new()))
    refused(url, "relay publishes to the default exchange", publish("", q))


def test_relay_no_declare_needs_no_configure(db, servers, broker, queues, rmq_user):
    q = queues.new()
    declare_consumer_queue(broker, q, ["payment.failed"])
    url = rmq_user("relaynd", permissions("relay", no_declare=True))
    body = payload()
    emit(db, "payment.failed", body["subscription_id"], "lp-" + new_id(), body)
    # declaring the exchange needs configure: refused by the broker, nothing spent
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=url)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = last_line(r, "relay")
    assert "403" in line and "ACCESS_REFUSED" in line, line
    assert db.query("SELECT status, attempts FROM idem.event_outbox") == [("pending", 0)]
    # --no-declare checks passively, then publishes
    r = run_idem("relay", "--once", "--no-declare", pg_url=db.url, amqp_url=url)
    assert r.returncode == 0, r.stderr
    assert db.count("idem.event_outbox", "status = 'sent'") == 1
    assert len(read_queue(broker, q, expect=1)) == 1
    # an exchange that is not there: one line naming it, exit 1
    missing = f"it.lp.none.{uuid.uuid4().hex[:8]}"
    emit(db, "payment.failed", body["subscription_id"], "lp-" + new_id(), body)
    r = run_idem("relay", "--once", "--no-declare", "--exchange", missing, pg_url=db.url,
                 amqp_url=url)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = one_line(r, "relay")
    assert missing in line and "does not exist" in line, line


# ----------------------------------------------------------------------------- consumer


def test_consumer_runs_with_its_permissions(db, servers, broker, queues, consumers,
                                            dead_letters, rmq_user):
    q = queues.new()
    other = queues.new("other")
    declare_consumer_queue(broker, other, ["invoice.paid"])
    url = rmq_user("consumer", permissions("consumer", q))
    c = consumers("billing", q, db, env={"IDEM_AMQP_URL": url})
    sub = new_id()
    broker.publish_event("payment.failed", payload(subscription_id=sub))
    bad = malformed(broker)
    wait_until(lambda: db.dunning_step(sub) == 1, 15, 0.1, "the event applied")
    # dead-lettered through QUEUE.dlx: no write on the default exchange or on QUEUE.dlq needed
    got = dead_letters(q).wait(1)
    assert [(d.props.message_id, d.error.split(":")[0]) for d in got] == [(bad, "malformed_json")]
    assert c.metric("idem_consumer_dead_lettered_total", code="malformed_json") == 1
    assert c.stop() == 0
    # what the consumer's user must not do
    refused(url, "consumer publishes to the default exchange", publish("", q))
    refused(url, "consumer publishes an event", publish(EXCHANGE, "payment.failed"))
    refused(url, "consumer reads another consumer's queue", get(other))
    refused(url, "consumer consumes another consumer's queue",
            lambda ch: ch.basic_consume(other, lambda *a: None))


def test_partitioned_consumer_runs_with_its_permissions(db, servers, broker, queues, consumers,
                                                        rmq_user):
    q = queues.new()
    queues.names += [q + ".p0", q + ".p1"]  # deleted after the test like the others
    url = rmq_user("consumerp", permissions("consumer", q, partitions=2))
    c = consumers("billing", q, db, args=["--partitions", "2"], env={"IDEM_AMQP_URL": url},
                  start=False)
    c.start(wait_ready=False)

    def consuming():
        assert c.running(), c.log()
        infos = broker.queue_infos([q + ".p0", q + ".p1"])
        return all(i is not None and i[1] >= 1 for i in infos.values())

    wait_until(consuming, 20, 0.1, "both partitions consumed")
    subs = [new_id() for _ in range(6)]
    for s in subs:
        broker.publish_event("payment.failed", payload(subscription_id=s))
    wait_until(lambda: all(db.dunning_step(s) == 1 for s in subs), 15, 0.1, "6 events applied")
    assert c.stop() == 0
    refused(url, "partitioned consumer publishes an event", publish(EXCHANGE, "payment.failed"))


def test_consumer_no_declare(db, servers, broker, queues, consumers, dead_letters, rmq_user):
    q = queues.new()
    url = rmq_user("consumernd", permissions("consumer", q, no_declare=True))
    # nothing declared yet: one line naming what is missing, exit 1
    r = run_idem("consume", "--consumer", "billing", "--queue", q, "--no-declare",
                 pg_url=db.url, amqp_url=url, timeout=30)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = one_line(r, "consume")
    assert re.search(re.escape(q) + r"(\.dlx|\.dlq)? does not exist", line), line

    # the topology, declared once by a consumer with the full permissions
    full = consumers("setup", q, db)
    assert full.stop() == 0
    c = consumers("billing", q, db, args=["--no-declare"], env={"IDEM_AMQP_URL": url})
    sub = new_id()
    broker.publish_event("payment.failed", payload(subscription_id=sub))
    bad = malformed(broker)
    wait_until(lambda: db.dunning_step(sub) == 1, 15, 0.1, "the event applied")
    got = dead_letters(q).wait(1)
    assert [d.props.message_id for d in got] == [bad]
    assert c.stop() == 0

    # the same user without --no-declare: the broker refuses the declarations; the daemon
    # says so and keeps trying
    d = consumers("billing", q, db, env={"IDEM_AMQP_URL": url}, start=False)
    d.start(wait_ready=False)
    wait_until(lambda: "403 ACCESS_REFUSED" in d.log(), 15, 0.1,
               lambda: f"a 403 in the log:\n{d.log()}")
    assert d.running()
    assert d.stop() == 0


# ----------------------------------------------------------------------------- operator


@pytest.mark.slow
def test_operator_lists_and_requeues_dead_letters(db, servers, broker, queues, consumers,
                                                  rmq_user):
    q = queues.new()
    c = consumers("billing", q, db)
    bad = malformed(broker)
    wait_until(lambda: broker.depth(q + ".dlq") == 1, 15, 0.1, "the dead letter")
    assert c.stop() == 0

    op = rmq_user("operator", permissions("operator", q))
    r = run_idem("dlq", "list", "--queue", q, "--json", amqp_url=op)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert [(m["event_id"], m["code"]) for m in listed] == [(bad, "malformed_json")]

    # without write on the default exchange a requeue is refused and moves nothing
    no_write = rmq_user("operatornw", (NONE, NONE, permissions("operator", q)[2]))
    r = run_idem("dlq", "requeue", "--queue", q, "--all", amqp_url=no_write)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = one_line(r, "dlq requeue")
    assert "403" in line and "ACCESS_REFUSED" in line, line
    assert broker.depth(q + ".dlq") == 1 and broker.depth(q) == 0

    r = run_idem("dlq", "requeue", "--queue", q, "--all", amqp_url=op)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"requeued 1 message from {q}.dlq to {q}"
    assert broker.depth(q + ".dlq") == 0 and broker.depth(q) == 1
    # what the operator's user must not do
    refused(op, "operator reads the live queue", get(q))
    refused(op, "operator publishes an event", publish(EXCHANGE, "payment.failed"))
