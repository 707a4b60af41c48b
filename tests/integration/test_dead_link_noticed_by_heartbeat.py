"""A dead link is noticed by heartbeats.

The consumer reaches RabbitMQ through a TCP proxy and runs with --heartbeat 2s. Once it is
consuming, the proxy freezes the existing connections: it stops forwarding both ways but closes
no socket, as when a NAT entry or a firewall state silently disappears. New connections pass.
Contract ("Failure policy (consumer)"): a dead link is noticed within two heartbeats and
reconnected. So the consumer logs the drop, reconnects (idem_reconnects_total{server="rabbitmq"}
>= 1), applies the events published after the freeze exactly once, and the deliveries the frozen
connection held come back (when the broker gives up on that connection) and are applied once.

Without heartbeats the consumer would wait on the silent socket for as long as TCP keepalive or
the kernel takes (minutes to hours) while its queue grows.
"""

import time
import urllib.parse

import pytest

from conftest import new_id, payload, wait_until
from consumer_helpers import FreezableProxy, add_failure, log_lines

# heartbeat timers: 6-8 s a case
pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(servers):
    u = urllib.parse.urlsplit(servers.amqp_url)
    p = FreezableProxy(u.hostname, u.port)
    yield p
    p.close()


# How the 2 s heartbeat is asked for: the flag; the URL's heartbeat= query parameter; both, where
# the flag wins over a URL asking for 600 s.
HOW = {
    "flag": (["--heartbeat", "2s"], ""),
    "url": ([], "?heartbeat=2"),
    "flag_wins": (["--heartbeat", "2s"], "?heartbeat=600"),
}


@pytest.mark.parametrize("how", list(HOW))
def test_dead_link_noticed_by_heartbeat_and_reconnected(db, queue, consumers, broker, servers,
                                                        dead_letters, proxy, how):
    args, query = HOW[how]
    c = consumers("billing", queue, db, args=args,
                  env={"IDEM_AMQP_URL": proxy.url(servers.amqp_url) + query})
    subs = []

    def publish(n):
        ids = []
        for _ in range(n):
            s = new_id()
            subs.append(s)
            ids.append(broker.publish_event("payment.failed", payload(subscription_id=s)))
        return ids

    ids = publish(3)
    c.wait_metric("idem_consumer_applied_total", 3)
    assert c.metric("idem_reconnects_total", server="rabbitmq") == 0

    frozen = proxy.freeze_existing()
    assert frozen >= 1
    t0 = time.monotonic()
    # The broker still believes in the frozen connection for a while: these go to it, and the
    # proxy holds them.
    ids += publish(3)
    c.wait_metric("idem_reconnects_total", 1, timeout=15, server="rabbitmq")
    noticed = time.monotonic() - t0
    ids += publish(3)

    c.wait_metric("idem_consumer_applied_total", len(ids), timeout=30)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    drops = log_lines(c, r"RabbitMQ connection dropped")
    assert drops, c.log()[-3000:]
    assert len(log_lines(c, r"connected to RabbitMQ, consuming")) >= 2
    assert proxy.accepted > frozen, "no new connection through the proxy"
    assert c.stop() == 0
    assert db.ledger() == sorted(("billing", e) for e in ids)
    assert [db.dunning_step(s) for s in subs] == [1] * len(subs)
    assert dead_letters(queue).poll() == []
    wait_until(lambda: broker.depth(queue) == 0, 10, what="the queue drained")
    print(f"dead link noticed after {noticed:.1f}s")


def test_idle_dead_letter_link_is_kept_alive(db, queue, consumers, broker, dead_letters):
    """Heartbeats flow on every link the consumer holds, also on the one that publishes dead
    letters, which may stay idle for long: a consumer that only heartbeats its consuming link
    has the broker close the idle one ("missed heartbeats from client") after two heartbeats;
    its next dead letter then fails and costs a reconnect that hands back every delivery in
    hand. Here: idle for more than two heartbeats, then a malformed message: dead-lettered at
    the first attempt, no reconnect."""
    c = consumers("billing", queue, db, args=["--heartbeat", "1s"])
    time.sleep(5)  # the premise: an idle spell of five heartbeats, with no dead letter
    broker.publish_raw(b"{not json", routing_key="payment.failed", message_id=new_id(),
                       type="payment.failed")
    letters = dead_letters(queue)
    letters.wait(1, timeout=10)
    assert c.metric("idem_consumer_dead_lettered_total", code="malformed_json") == 1
    failed = log_lines(c, r"dead-lettering failed")
    assert c.metric("idem_reconnects_total", server="rabbitmq") == 0 and not failed, \
        "the idle dead-letter connection was closed by the broker:\n" + "\n".join(
            log_lines(c, r"dead-letter|RabbitMQ connection dropped"))
    assert c.stop() == 0


def test_retries_exhausted_after_a_long_wait_is_dead_lettered(db, queue, consumers, broker,
                                                              dead_letters):
    """A delivery retried for longer than two heartbeats ends in the DLQ as retries_exhausted
    after exactly max-retries + 1 tries. If the dead-letter link died of missed heartbeats
    meanwhile, its dead-lettering fails, the window is handed back, the broker redelivers the
    event and its tries start again from zero: the same again at the end, for ever."""
    add_failure(db, "billing.dunning", "40001")
    c = consumers("billing", queue, db, args=["--heartbeat", "1s", "--max-retries", "3"])
    eid = broker.publish_event("payment.failed", payload())
    letters = dead_letters(queue)
    # Tries at 0, 1, 3 and 7 s, then the dead letter.
    try:
        letters.wait(1, timeout=15)
    except AssertionError:
        raise AssertionError(
            "not dead-lettered within 15 s; tries so far: "
            f"{c.metric('idem_consumer_handler_errors_total'):.0f}, reconnects: "
            f"{c.metric('idem_reconnects_total', server='rabbitmq'):.0f}\n" + "\n".join(
                log_lines(c, r"dead-letter|RabbitMQ connection dropped")))
    assert [d.props.message_id for d in letters.got] == [eid]
    assert letters.got[0].error.startswith("retries_exhausted: ")
    assert c.metric("idem_consumer_handler_errors_total") == 4
    assert c.metric("idem_reconnects_total", server="rabbitmq") == 0
    assert c.stop() == 0
    assert db.ledger() == []
