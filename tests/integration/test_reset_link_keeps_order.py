"""A consumer whose link freezes and is reset keeps each subscription's order (plain queue).

One `idem consume` (the default topology, one process) reaches RabbitMQ through a TCP proxy,
with --heartbeat 5s, while `idem relay` publishes a steady billing load emitted through
idem_emit. Mid-load the proxy freezes the consumer's connections (the broker goes on delivering
into the frozen link, up to --prefetch), then resets their client side only: the consumer sees
its link reset and reconnects at once, while the broker still holds the old connection's
unacknowledged deliveries until its heartbeat timeout. Contract ("Order and scale-out"): every
queue has x-single-active-consumer, so the new connection is given nothing before the broker
has returned the old one's deliveries, and they come first. Afterwards every event is applied
once and each subscription's effects are in emit order (audit of group_helpers).

Without single active consumer the new connection would be fed the later events at once and
apply them before the ~200 the old connection held come back (12 of 12 subscriptions out of
order when make chaos found it)."""

import urllib.parse

import pytest

from conftest import wait_until
from consumer_helpers import FreezableProxy
from group_helpers import Emitter, audit, install_effect_log, plan_billing
from relay_helpers import relay_daemons

__all__ = ["relay_daemons"]

SUBS = 20
PER_SUB = 80
RATE = 300.0  # events/s: 1,600 events in about 5.3 s


@pytest.fixture
def proxy(servers):
    u = urllib.parse.urlsplit(servers.amqp_url)
    p = FreezableProxy(u.hostname, u.port)
    yield p
    p.close()


@pytest.mark.slow  # a link frozen past the heartbeats, then reset: 15-30 s
def test_frozen_and_reset_link_keeps_subscription_order(db, servers, broker, queue, consumers,
                                                        relay_daemons, proxy):
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=12)
    c = consumers("billing", queue, db, args=["--heartbeat", "5s"],
                  env={"IDEM_AMQP_URL": proxy.url(servers.amqp_url)})
    relay_daemons(["--poll-interval", "50ms"], wait_ready=True)
    emitter = Emitter(db.url, order, rate=RATE, per_tx=5)
    emitter.start()
    c.wait_metric("idem_consumer_applied_total", 200, timeout=30)

    assert proxy.freeze_existing() >= 1
    # the broker goes on delivering into the frozen link until --prefetch (200) is unacked
    wait_until(lambda: emitter.progress >= 1000 or None, 30, 0.05, "the load going on")
    assert proxy.reset_frozen_clients() >= 1
    c.wait_metric("idem_reconnects_total", 1, timeout=15, server="rabbitmq")
    emitter.finish()

    total = len(order) + sum(e.type == "invoice.paid" for e in order)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 90, 0.2,
               lambda: f"{total} ledger rows (have "
               f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')})")
    assert c.running(), c.log()[-3000:]
    summary = audit(db.query, plan)
    assert summary["ledger_rows"] == total
    assert broker.depth(queue + ".dlq") == 0
    assert c.stop() == 0
