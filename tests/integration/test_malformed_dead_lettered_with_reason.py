"""Every malformed delivery reaches QUEUE.dlq with x-idem-error "<code>: <detail>", its original
body byte for byte, its message_id and its custom headers, while good events around it are
applied."""

import json
import time

import pytest

from conftest import new_id, payload

LIMIT = 2048  # --max-message-bytes


def padded(body, size):
    """body (a dict) as JSON of exactly size bytes, padded with an extra (ignored) field."""
    raw = json.dumps(dict(body, pad=""))
    raw = json.dumps(dict(body, pad="x" * (size - len(raw))))
    assert len(raw) == size
    return raw.encode()


def cases():
    now = int(time.time())
    pf = "payment.failed"
    c = {}
    # name: (expected code, publish kwargs)
    c["malformed_json"] = ("malformed_json", dict(body=b"{not json", routing_key=pf,
                                                  message_id=new_id(), type=pf))
    c["missing_event_id"] = ("missing_event_id", dict(body=json.dumps(payload()), routing_key=pf,
                                                      message_id=None, type=pf))
    c["invalid_event_id"] = ("invalid_event_id", dict(body=json.dumps(payload()), routing_key=pf,
                                                      message_id="nope", type=pf))
    c["invalid_event_id_header"] = ("invalid_event_id", dict(
        body=json.dumps(payload()), routing_key=pf, message_id=None, type=pf,
        headers={"event_id": "123"}))
    c["unknown_type"] = ("unknown_type", dict(body=json.dumps(payload()), routing_key=pf,
                                              message_id=new_id(), type="no.such.type"))
    c["oversized"] = ("oversized", dict(body=padded(payload(), LIMIT + 1), routing_key=pf,
                                        message_id=new_id(), type=pf))
    p = payload()
    del p["amount_cents"]
    c["missing_amount"] = ("invalid_payload", dict(body=json.dumps(p), routing_key=pf,
                                                   message_id=new_id(), type=pf))
    c["negative_amount"] = ("invalid_payload", dict(body=json.dumps(payload(amount_cents=-1)),
                                                    routing_key=pf, message_id=new_id(), type=pf))
    c["string_amount"] = ("invalid_payload", dict(body=json.dumps(payload(amount_cents="100")),
                                                  routing_key=pf, message_id=new_id(), type=pf))
    c["lowercase_currency"] = ("invalid_payload", dict(body=json.dumps(payload(currency="usd")),
                                                       routing_key=pf, message_id=new_id(), type=pf))
    c["bad_invoice_id"] = ("invalid_payload", dict(body=json.dumps(payload(invoice_id="inv-1")),
                                                   routing_key=pf, message_id=new_id(), type=pf))
    c["json_array"] = ("invalid_payload", dict(body=b"[1,2]", routing_key=pf,
                                               message_id=new_id(), type=pf))
    c["stale"] = ("stale", dict(body=json.dumps(payload()), routing_key=pf, message_id=new_id(),
                                type=pf, timestamp=now - 2 * 86400))
    for name, (_, kw) in c.items():
        if "timestamp" not in kw:
            kw["timestamp"] = now
        kw["headers"] = dict(kw.get("headers") or {}, **{"x-case": name, "x-custom": "keep-me"})
        if isinstance(kw["body"], str):
            kw["body"] = kw["body"].encode()
    return c


def test_malformed_deliveries_dead_lettered_while_good_ones_apply(db, queue, consumers, broker,
                                                                 dead_letters):
    c = consumers("billing", queue, db, args=["--max-message-bytes", str(LIMIT),
                                             "--dedup-window", "1d", "--max-retries", "1"])
    sub = new_id()
    first = broker.publish_event("payment.failed", payload(subscription_id=sub))
    all_cases = cases()
    for name, (_, kw) in all_cases.items():
        broker.publish_raw(**kw)
    # Routing-key fallback for the type, straight to the queue: still unknown.
    unrouted = json.dumps(payload()).encode()
    broker.to_queue(queue, unrouted, message_id=new_id(), type=None,
                    headers={"x-case": "unknown_routing_key"}, timestamp=int(time.time()))
    # A body of exactly the limit is accepted (extra fields are ignored).
    at_limit_sub = new_id()
    at_limit = broker.publish_event("payment.failed",
                                    padded(payload(subscription_id=at_limit_sub), LIMIT))
    last = broker.publish_event("payment.failed", payload(subscription_id=sub))

    expected = len(all_cases) + 1
    dl = dead_letters(queue)
    dl.wait(expected, timeout=20)
    c.wait_metric("idem_consumer_applied_total", 3)
    for code in ("malformed_json", "missing_event_id", "invalid_event_id", "unknown_type",
                 "oversized", "invalid_payload", "stale"):
        want = sum(1 for cc, _ in all_cases.values() if cc == code)
        want += 1 if code == "unknown_type" else 0
        assert c.metric("idem_consumer_dead_lettered_total", code=code) == want, code
    assert c.stop() == 0
    dl.poll()

    got = dl.by_case()
    assert sorted(got) == sorted(list(all_cases) + ["unknown_routing_key"])
    assert len(dl.got) == expected, dl.got
    problems = []
    for name, (code, kw) in all_cases.items():
        d = got[name]
        if not (d.error or "").startswith(code + ": ") or len(d.error) <= len(code) + 2:
            problems.append(f"{name}: x-idem-error {d.error!r}, want '{code}: <detail>'")
        if d.body != kw["body"]:
            problems.append(f"{name}: body changed: {d.body[:60]!r} != {kw['body'][:60]!r}")
        if d.props.message_id != kw["message_id"]:
            problems.append(f"{name}: message_id {d.props.message_id!r} != {kw['message_id']!r}")
        if d.props.type != kw["type"]:
            problems.append(f"{name}: type {d.props.type!r} != {kw['type']!r}")
        if d.props.timestamp != kw["timestamp"]:
            problems.append(f"{name}: timestamp {d.props.timestamp!r} != {kw['timestamp']!r}")
        if d.header("x-custom") != "keep-me":
            problems.append(f"{name}: custom header lost: {d.headers!r}")
        if d.props.content_type != "application/json":
            problems.append(f"{name}: content_type {d.props.content_type!r}")
    u = got["unknown_routing_key"]
    if not (u.error or "").startswith("unknown_type: ") or u.body != unrouted:
        problems.append(f"unknown_routing_key: {u!r}")
    assert problems == []

    # Only the good events took effect.
    assert db.dunning_step(sub) == 2
    assert db.dunning_step(at_limit_sub) == 1
    assert db.count("billing.dunning") == 2
    assert db.ledger() == sorted(("billing", i) for i in (first, at_limit, last))
    assert broker.depth(queue) == 0


@pytest.mark.parametrize("age", ["fresh", "none"])
def test_not_stale_is_processed(db, queue, consumers, broker, dead_letters, age):
    """Within the dedup window, or without a timestamp at all, a delivery is processed."""
    c = consumers("billing", queue, db, args=["--dedup-window", "1d"])
    ts = int(time.time()) - 3600 * 23 if age == "fresh" else None
    body = payload()
    eid = broker.publish_event("payment.failed", body, timestamp=ts)
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    assert dead_letters(queue).poll() == []
