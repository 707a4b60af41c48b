"""Publishers are authenticated: the relay sets the AMQP `user_id` property to its own RabbitMQ
user (which RabbitMQ checks against the connection's login), and `idem consume
--trusted-publisher USER` dead-letters, as `untrusted` and before any claim, every delivery whose
user_id is absent or not one of them.

The attack this closes: a service with write permission on the exchange publishes a
`receipt.requested` whose message_id is the id a real event will have (ids are md5 of
documented keys). Without the check the forgery is applied and the real event later dropped as a
duplicate. With it the forgery is dead-lettered (its user_id kept as x-idem-original-user-id) and
the real one, relayed later, is applied. An operator whose user is trusted can requeue a dead
letter after looking at it: the requeued copy carries the operator's own user_id.
"""

import json
import time
import urllib.parse

import pika

from conftest import EXCHANGE, new_id, payload, run_idem, wait_until
from relay_helpers import declare_consumer_queue, emit, md5_uuid, read_queue, relay_daemons
from test_rabbitmq_least_privilege import permissions

__all__ = ["relay_daemons"]


def user_of(url):
    return urllib.parse.unquote(urllib.parse.urlsplit(url).username)


def publish_as(url, routing_key, body, message_id, event_type, user_id=None):
    """Publishes one event-like message logging in as the user of url (confirmed)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(message_id=message_id, type=event_type,
                                     content_type="application/json", delivery_mode=2,
                                     timestamp=int(time.time()), user_id=user_id)
        ch.basic_publish(exchange=EXCHANGE, routing_key=routing_key, body=json.dumps(body),
                         properties=props, mandatory=True)
    finally:
        conn.close()


def forger_url(rmq_user):
    """A service that may write to the exchange and nothing else (like the relay)."""
    return rmq_user("forger", permissions("relay", no_declare=True))


def test_relay_sets_user_id_to_its_login(db, servers, broker, queues, rmq_user, tmp_path):
    q = queues.new()
    declare_consumer_queue(broker, q, ["payment.failed"])
    relay_url = rmq_user("relay", permissions("relay"))
    bodies = [payload() for _ in range(3)]
    ids = [emit(db, "payment.failed", b["subscription_id"], "uid-" + new_id(), b) for b in bodies]
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=relay_url)
    assert r.returncode == 0, r.stderr
    got = read_queue(broker, q, expect=3)
    assert sorted(m.event_id for m in got) == sorted(ids)
    assert {m.props.user_id for m in got} == {user_of(relay_url)}

    # the user of a URL without a password, logging in with the password file's
    u = urllib.parse.urlsplit(relay_url)
    pwfile = tmp_path / "amqp-password"
    pwfile.write_text(u.password + "\n")
    pwfile.chmod(0o600)
    bare = urllib.parse.urlunsplit(u._replace(netloc=f"{u.username}@{u.hostname}:{u.port}"))
    eid = emit(db, "payment.failed", bodies[0]["subscription_id"], "uid2-" + new_id(), bodies[0])
    r = run_idem("relay", "--once", "--amqp-password-file", str(pwfile), pg_url=db.url,
                 amqp_url=bare)
    assert r.returncode == 0, r.stderr
    got = read_queue(broker, q, expect=1)
    assert [(m.event_id, m.props.user_id) for m in got] == [(eid, user_of(relay_url))]


def test_forgery_by_another_user_is_untrusted_and_the_real_event_applied(
        db, servers, queue, broker, consumers, relay_daemons, dead_letters, rmq_user):
    relay_user = user_of(servers.amqp_url)
    c = consumers("billing", queue, db, args=["--trusted-publisher", relay_user])
    forger = forger_url(rmq_user)
    real_sub, evil_sub, inv = new_id(), new_id(), new_id()
    paid_id = md5_uuid(f"invoice:{inv}:paid")
    receipt_id = md5_uuid(f"idem:{paid_id}:receipt")  # the id the real receipt will have

    # the forgery arrives first, from a user the consumer does not trust (naming itself, as
    # RabbitMQ lets it); one without any user_id is not trusted either; one claiming to be the
    # relay is refused by RabbitMQ itself
    evil = payload(subscription_id=evil_sub, invoice_id=inv, amount_cents=1)
    publish_as(forger, "receipt.requested", evil, receipt_id, "receipt.requested",
               user_id=user_of(forger))
    absent = new_id()
    publish_as(forger, "receipt.requested", evil, absent, "receipt.requested")
    try:
        publish_as(forger, "receipt.requested", evil, new_id(), "receipt.requested",
                   user_id=relay_user)
        raise AssertionError("RabbitMQ accepted a user_id that is not the publisher's login")
    except pika.exceptions.AMQPError as e:
        assert "406" in str(e) or "PRECONDITION_FAILED" in str(e), e
    c.wait_metric("idem_consumer_dead_lettered_total", 2, code="untrusted")
    dl = dead_letters(queue).wait(2)
    by_id = {m.props.message_id: m for m in dl}
    assert set(by_id) == {receipt_id, absent}
    forged = by_id[receipt_id]
    assert forged.error.startswith("untrusted: "), forged.error
    assert user_of(forger) in forged.error
    assert forged.header("x-idem-original-user-id") == user_of(forger)
    assert forged.props.user_id is None
    assert by_id[absent].error.startswith("untrusted: "), by_id[absent].error
    assert "absent" in by_id[absent].error
    assert db.count("billing.receipts") == 0
    assert db.ledger("billing") == [], "an untrusted delivery is never claimed"

    # the real invoice.paid, emitted later and relayed, and its follow-up receipt are applied
    relay_daemons(name="relay", wait_ready=True)
    body = payload(subscription_id=real_sub, invoice_id=inv, amount_cents=4200)
    ip = emit(db, "invoice.paid", real_sub, f"invoice:{inv}:paid", body)
    wait_until(lambda: db.count("billing.receipts") == 1, 20, 0.1, "the real receipt")
    assert db.query("SELECT subscription_id::text, event_id::text FROM billing.receipts") == [
        (real_sub, receipt_id)]
    c.wait_handled(2)
    assert sorted(e for _, e in db.ledger("billing")) == sorted([ip, receipt_id])
    assert c.metric("idem_consumer_dead_lettered_total", code="untrusted") == 2
    assert c.metric("idem_consumer_dead_lettered_total") == 2


def test_trusted_operator_requeues_an_untrusted_dead_letter(db, servers, queue, broker, consumers,
                                                             dead_letters, rmq_user):
    relay_user = user_of(servers.amqp_url)
    op = rmq_user("operator", permissions("operator", queue))
    foreign = rmq_user("foreign", permissions("relay", no_declare=True))
    c = consumers("billing", queue, db,
                  args=["--trusted-publisher", relay_user, "--trusted-publisher", user_of(op)])
    sub = new_id()
    eid = new_id()
    # a partner's message, legitimate after all, but from a user that is not trusted
    publish_as(foreign, "payment.failed", payload(subscription_id=sub), eid, "payment.failed")
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="untrusted")
    wait_until(lambda: broker.depth(queue + ".dlq") == 1, 10, 0.1, "the dead letter")
    assert db.dunning_step(sub) is None

    # a requeue by an untrusted user would only be dead-lettered again: the operator's is applied
    r = run_idem("dlq", "requeue", "--queue", queue, "--all", amqp_url=op)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"requeued 1 message from {queue}.dlq to {queue}"
    c.wait_metric("idem_consumer_applied_total", 1)
    assert db.dunning_step(sub) == 1
    assert db.ledger("billing") == [("billing", eid)]
    assert c.metric("idem_consumer_dead_lettered_total") == 1
    assert broker.depth(queue + ".dlq") == 0


def test_requeued_copy_carries_the_requeuer_as_user_id(db, servers, queue, broker, consumers,
                                                       dead_letters, rmq_user):
    foreign = rmq_user("foreign", permissions("relay", no_declare=True))
    c = consumers("billing", queue, db, args=["--trusted-publisher", "nobody-at-all"])
    eid = new_id()
    publish_as(foreign, "payment.failed", payload(), eid, "payment.failed",
               user_id=user_of(foreign))
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="untrusted")
    assert c.stop() == 0
    wait_until(lambda: broker.depth(queue + ".dlq") == 1, 10, 0.1, "the dead letter")
    r = run_idem("dlq", "requeue", "--queue", queue, "--all", amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stderr
    got = wait_until(lambda: broker.get_all(queue), 10, 0.1, "the requeued copy")
    assert len(got) == 1
    m = got[0]
    assert m.props.message_id == eid
    assert m.props.user_id == user_of(servers.amqp_url)
    assert m.header("x-idem-original-user-id") == user_of(foreign)
    assert m.error is None


def test_help_lists_trusted_publisher():
    r = run_idem("consume", "--help")
    assert r.returncode == 0
    assert "--trusted-publisher" in r.stdout
