"""Oversized bodies are decided from the content header.

The body size is announced in the content header, before any body frame. A consumer with
--max-message-bytes 1048576 must decide "oversized" from it and never read such a body into
memory: it streams the body, frame by frame, into the dead-letter copy. Three 48 MiB messages
among good events: all three land in QUEUE.dlq with code oversized and their full original body
(same length, same SHA-256), the good events are applied, and the consumer's peak resident size
(VmHWM) stays below 32 MiB. A body of exactly --max-message-bytes is accepted.

Without it, a publisher could make every consumer allocate whatever size it announces (up to the
broker's limit, times the prefetch): one bad producer takes the consumers down by memory. And
an oversized message must still reach the DLQ intact, evidence for whoever sent it.
"""

import hashlib
import json
import os

import pytest

from conftest import new_id, payload
from consumer_helpers import vm_hwm_kib

LIMIT = 1048576
BIG = 48 * 1024 * 1024


def padded(body, size):
    """body (a dict) as JSON of exactly size bytes, padded with an extra (ignored) field."""
    raw = json.dumps(dict(body, pad=""))
    raw = json.dumps(dict(body, pad="x" * (size - len(raw))))
    assert len(raw) == size
    return raw.encode()


def big_body(i):
    # Distinct, incompressible-looking content, so that a truncated or mixed-up copy shows.
    chunk = os.urandom(1024 * 1024)
    return (b"%d:" % i + chunk * 48)[:BIG]


@pytest.mark.slow  # streams large bodies: 9-25 s
def test_oversized_bodies_streamed_to_the_dlq(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db, args=["--max-message-bytes", str(LIMIT)])
    subs = [new_id() for _ in range(3)]
    good = []
    bigs = {}
    good.append(broker.publish_event("payment.failed", payload(subscription_id=subs[0])))
    for i in range(3):
        body = big_body(i)
        eid = broker.publish_event("payment.failed", body, headers={"x-case": f"big{i}"})
        bigs[eid] = (len(body), hashlib.sha256(body).hexdigest())
        del body
        if i == 0:
            good.append(broker.publish_event("payment.failed",
                                             payload(subscription_id=subs[1])))
    at_limit_sub = new_id()
    at_limit = broker.publish_event("payment.failed",
                                    padded(payload(subscription_id=at_limit_sub), LIMIT))
    good.append(at_limit)
    good.append(broker.publish_event("payment.failed", payload(subscription_id=subs[2])))

    c.wait_metric("idem_consumer_dead_lettered_total", 3, timeout=60, code="oversized")
    c.wait_metric("idem_consumer_applied_total", len(good), timeout=15)
    hwm = vm_hwm_kib(c.proc.pid)
    print(f"consumer VmHWM {hwm} KiB")
    assert c.metric("idem_consumer_dead_lettered_total") == 3
    assert c.stop() == 0
    assert hwm < 32 * 1024, f"consumer peak RSS {hwm} KiB: an oversized body was held whole"

    got = dead_letters(queue).poll()
    assert sorted(d.props.message_id for d in got) == sorted(bigs)
    for d in got:
        assert d.error.startswith("oversized: "), d.error
        want_len, want_hash = bigs[d.props.message_id]
        assert len(d.body) == want_len
        assert hashlib.sha256(d.body).hexdigest() == want_hash
        assert d.header("x-case") is not None
    del got
    assert db.ledger() == sorted(("billing", e) for e in good)
    assert [db.dunning_step(s) for s in subs] == [1, 1, 1]
    assert db.dunning_step(at_limit_sub) == 1
    assert broker.depth(queue) == 0
