"""The dead-letter copy always lands, whatever the message carries.

The copy is published persistent through the direct exchange QUEUE.dlx bound to QUEUE.dlq, with
the original body, properties and headers plus x-idem-error; the original user_id and expiration
are dropped from it and kept as headers x-idem-original-user-id / x-idem-original-expiration
(contract, "Messages on the wire").

What would break without each rule:
- user_id: RabbitMQ refuses a publish whose user_id is not the publishing connection's user. A
  consumer logged in as another user would have its copy refused (channel closed), reconnect,
  get the message again and loop forever, never acking it.
- expiration: the copy would expire from the DLQ after the original TTL: the evidence is lost.
- delivery_mode 1: the copy would not survive a broker restart.
- headers near the frame size: the copy plus x-idem-error would not fit one header frame; the
  publish would fail on every try (the same loop), unless the consumer shortens its reason and
  drops the largest original headers, naming them in x-idem-dropped-headers.
"""

import hashlib
import time
import urllib.parse
import uuid

import pytest

from conftest import new_id, payload, wait_until

PF = "payment.failed"
BAD_JSON = b"{not json"


def publish_malformed(broker, **kw):
    eid = new_id()
    headers = dict(kw.pop("headers", {}) or {}, **{"x-custom": "keep-me"})
    broker.publish_raw(kw.pop("body", BAD_JSON), routing_key=PF, message_id=eid, type=PF,
                       timestamp=int(time.time()), headers=headers, **kw)
    return eid


def check_copy(d, queue, eid, body=BAD_JSON, code="malformed_json"):
    """What every dead-letter copy must be: through QUEUE.dlx, persistent, original body, id and
    headers, and the reason."""
    assert d.props.message_id == eid
    assert d.method.exchange == queue + ".dlx", d.method
    assert d.method.routing_key == queue + ".dlq", d.method
    assert d.props.delivery_mode == 2
    assert d.body == body
    assert d.props.type == PF
    assert (d.error or "").startswith(code + ": "), d.error


def test_copy_of_another_users_message_drops_user_id(db, queue, consumers, broker, servers,
                                                     dead_letters):
    user = "it_other_" + uuid.uuid4().hex[:8]
    password = uuid.uuid4().hex
    servers.rmqctl("add_user", user, password)
    try:
        servers.rmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        u = urllib.parse.urlsplit(servers.amqp_url)
        other_url = urllib.parse.urlunsplit(
            u._replace(netloc=f"{user}:{password}@{u.hostname}:{u.port}"))
        c = consumers("billing", queue, db, env={"IDEM_AMQP_URL": other_url})
        eid = publish_malformed(broker, user_id="guest")
        letters = dead_letters(queue)
        letters.wait(1, timeout=10)
        good = payload()
        geid = broker.publish_event(PF, good)
        c.wait_metric("idem_consumer_applied_total", 1)
        # Dead-lettered once, no reconnect: the copy was not refused.
        assert c.metric("idem_consumer_dead_lettered_total", code="malformed_json") == 1
        assert c.metric("idem_reconnects_total", server="rabbitmq") == 0
        assert "dead-lettering failed" not in c.log()
        assert c.stop() == 0
        dl = letters.poll()
        assert len(dl) == 1, dl
        d = dl[0]
        check_copy(d, queue, eid)
        assert d.props.user_id is None
        assert d.header("x-idem-original-user-id") == "guest"
        assert d.header("x-custom") == "keep-me"
        assert db.ledger() == [("billing", geid)]
        assert broker.queue_info(queue)[0] == 0
    finally:
        servers.rmqctl("delete_user", user)


def test_copy_does_not_expire(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db)
    eid = publish_malformed(broker, expiration="2000")
    dlq = queue + ".dlq"
    wait_until(lambda: broker.depth(dlq) == 1, 10, 0.1, "the copy in the DLQ")
    # Still there after twice the original TTL (the copy has no expiration of its own).
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4.5:
        assert broker.depth(dlq) == 1, "the dead-letter copy expired"
        time.sleep(0.5)
    assert c.stop() == 0
    dl = dead_letters(queue).poll()
    assert len(dl) == 1
    d = dl[0]
    check_copy(d, queue, eid)
    assert d.props.expiration is None
    assert d.header("x-idem-original-expiration") == "2000"
    assert d.header("x-custom") == "keep-me"


def test_copy_is_persistent(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db)
    eid = publish_malformed(broker, delivery_mode=1)
    letters = dead_letters(queue)
    letters.wait(1, timeout=10)
    assert c.stop() == 0
    d = letters.got[0]
    check_copy(d, queue, eid)  # delivery_mode 2
    assert d.header("x-custom") == "keep-me"


def props_size(value_len, extra_headers=()):
    """Encoded size of the properties publish_malformed sends with one header x-big of
    value_len bytes (AMQP 0-9-1 encoding; pika sends exactly these fields)."""
    size = 2  # property flags
    size += 1 + len("application/json")  # content_type
    size += 4  # headers table length
    hdrs = [("x-big", value_len), ("x-custom", len("keep-me")), *extra_headers]
    for key, vlen in hdrs:
        size += 1 + len(key) + 1 + 4 + vlen
    size += 1  # delivery_mode
    size += 1 + 36  # message_id
    size += 8  # timestamp
    size += 1 + len(PF)  # type
    return size


FRAME_MAX = 131072
# a header frame: 7 bytes frame header + 1 end octet + class, weight and body size (12) + props
PROPS_MAX = FRAME_MAX - 8 - 12


@pytest.mark.parametrize("slack", [11_000, 60], ids=["120k_header", "at_frame_limit"])
def test_copy_with_headers_near_the_frame_size_lands(db, queue, consumers, broker, dead_letters,
                                                     slack):
    """A 120,000-byte header (the copy still fits), and a header that leaves only `slack` bytes of
    the frame (the copy with x-idem-error cannot fit: something must be shortened or dropped)."""
    value_len = PROPS_MAX - slack - props_size(0)
    assert props_size(value_len) == PROPS_MAX - slack
    big = ("b" * value_len)
    c = consumers("billing", queue, db)
    eid = publish_malformed(broker, headers={"x-big": big})
    letters = dead_letters(queue)
    letters.wait(1, timeout=10)
    good = broker.publish_event(PF, payload())
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.metric("idem_consumer_dead_lettered_total", code="malformed_json") == 1
    assert c.metric("idem_reconnects_total", server="rabbitmq") == 0
    assert c.stop() == 0
    dl = letters.poll()
    assert len(dl) == 1
    d = dl[0]
    check_copy(d, queue, eid)
    assert hashlib.sha256(d.body).digest() == hashlib.sha256(BAD_JSON).digest()
    dropped = [h.strip() for h in (d.header("x-idem-dropped-headers") or "").split(",") if h]
    for name in ("x-big", "x-custom"):
        if name in dropped:
            assert name not in d.headers, f"{name} both kept and named as dropped"
        else:
            assert name in d.headers, f"{name} missing and not named in x-idem-dropped-headers"
    if "x-big" in d.headers:
        assert d.header("x-big") == big
    if slack == 11_000:
        assert dropped == [], "a 120,000-byte header fits with the reason: nothing to drop"
    assert db.ledger() == [("billing", good)]
    assert broker.queue_info(queue)[0] == 0
