"""Hostile timestamps are treated as absent.

The AMQP timestamp is an unsigned 64-bit number any publisher may set. Contract ("Failure policy
(consumer)"): a timestamp more than 1 day in the future, or negative (as a signed 64-bit number:
2^63 and above), is treated as absent, and a delivery without a timestamp is processed. So valid
events stamped 2^63, 2^64-1, now in milliseconds, now in nanoseconds, or now + 2 days are applied,
not dead-lettered as stale, and the consumer survives them. Timestamp 0 is a real (very old)
time: with --dedup-window 1d that event is stale.

Without the rule, an overflow in the age computation could make such an event look ancient
(stale: dead-lettered though new) or infinitely young (never stale: a redelivery older than the
ledger's retention applied twice), or crash the consumer on a signed overflow.
"""

import time

from conftest import new_id, payload


def test_hostile_timestamps_are_treated_as_absent(db, queue, consumers, broker, dead_letters):
    c = consumers("billing", queue, db, args=["--dedup-window", "1d"])
    now = int(time.time())
    stamps = {
        "2^63": 2 ** 63,
        "2^64-1": 2 ** 64 - 1,
        "now_ms": now * 1000,
        "now_ns": now * 1_000_000_000,
        "now+2d": now + 2 * 86400,
    }
    applied = {}
    subs = {}
    for name, ts in stamps.items():
        subs[name] = new_id()
        applied[name] = broker.publish_event("payment.failed",
                                             payload(subscription_id=subs[name]),
                                             timestamp=ts, headers={"x-case": name})
    # A real but old timestamp: stale under a 1-day window.
    stale = broker.publish_event("payment.failed", payload(), timestamp=0,
                                 headers={"x-case": "zero"})
    # Within a day ahead (clock skew): a real timestamp, fresh.
    skew_sub = new_id()
    skewed = broker.publish_event("payment.failed", payload(subscription_id=skew_sub),
                                  timestamp=now + 3600, headers={"x-case": "now+1h"})

    letters = dead_letters(queue)
    letters.wait(1, timeout=10)
    c.wait_metric("idem_consumer_applied_total", len(applied) + 1)
    assert c.running()
    assert c.metric("idem_consumer_dead_lettered_total", code="stale") == 1
    assert c.metric("idem_consumer_dead_lettered_total") == 1
    # Treated as absent: no commit-minus-timestamp lag is computed from them (only the skewed
    # one, whose timestamp counts, may be observed).
    assert c.metric("idem_consumer_lag_seconds_count") <= 1
    assert c.stop() == 0

    got = letters.poll()
    assert [d.props.message_id for d in got] == [stale], got
    assert got[0].error.startswith("stale: "), got[0].error
    assert got[0].props.timestamp == 0
    assert db.ledger() == sorted([("billing", e) for e in applied.values()]
                                 + [("billing", skewed)])
    for name, sub in subs.items():
        assert db.dunning_step(sub) == 1, name
    assert db.dunning_step(skew_sub) == 1
    assert broker.depth(queue) == 0
