"""The stale check agrees with retention (contract, "Messages on the wire": `timestamp` = the
event's created_at in whole seconds, rounded down; "Stale": a delivery older than the consumer's
dedup window is dead-lettered `stale`; `x-idem-seq` strictly increasing per subscription).

Retention deletes a ledger row once it is older than the dedup window by the DATABASE's clock;
the consumer's stale check is what keeps a delivery whose ledger row may be gone from being
applied a second time. The two only agree if they use the same clock and the same rounding:
- a timestamp rounded up (or to nearest) makes an event look younger than it is, so a delivery
  just past the window is applied although its ledger row may already be deleted;
- a consumer that ages deliveries by its own clock, running 2 h slow, applies deliveries up to
  2 h past the window (their ledger rows deleted by a retention run on the database's clock).
And consumers that order or detect gaps by `x-idem-seq` need it to be the outbox row's seq.
"""

import datetime
import os
import subprocess
import time

import pytest

from conftest import IDEM, new_id, payload, wait_until
from relay_helpers import (declare_consumer_queue, emit, emit_many, outbox, read_queue,
                           relay_once)

TYPE = "payment.failed"
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
SKEW = {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": "-2h", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def test_timestamp_is_created_at_rounded_down(db, servers, queue, broker):
    """(a) created_at = a whole second + 0.9 s, 10 s ago: the timestamp is that whole second."""
    declare_consumer_queue(broker, queue, [TYPE])
    s = new_id()
    ids = [emit(db, TYPE, s, f"k{i}:{new_id()}", payload(subscription_id=s, n=i))
           for i in range(3)]
    # .9 below a second, exactly on a second, and .000001 above one
    for eid, frac in zip(ids, ("0.9", "0", "0.000001")):
        db.execute("UPDATE idem.event_outbox SET created_at = date_trunc('second', now())"
                   " - interval '10 s' + %s::interval WHERE event_id = %s",
                   f"{frac} s", eid)
    want = dict(db.query("SELECT event_id::text, extract(epoch FROM date_trunc('second',"
                         " created_at))::bigint FROM idem.event_outbox"))
    frac = dict(db.query("SELECT event_id::text, extract(epoch FROM created_at)"
                         " - floor(extract(epoch FROM created_at)) FROM idem.event_outbox"))
    assert float(frac[ids[0]]) == pytest.approx(0.9)

    r = relay_once(db, servers)
    assert r.returncode == 0, r.stderr
    got = {m.event_id: m.props.timestamp for m in read_queue(broker, queue, expect=3)}
    assert got == want, {i: (got.get(i), want[i]) for i in ids}
    assert abs(got[ids[0]] - (time.time() - 10)) < 5


def test_consumer_ages_deliveries_by_the_database_clock(db, queue, broker, consumers,
                                                        dead_letters):
    """(b) A consumer whose own clock is 2 h slow (libfaketime), --dedup-window 1d: a delivery
    25 h old by the real (database) clock is dead-lettered `stale` although by the consumer's
    clock it is 23 h old; one 23 h old is applied."""
    if not os.path.exists(LIBFAKETIME):
        pytest.fail(f"{LIBFAKETIME} is missing: install faketime (scripts/deps.sh)")
    # The skew takes effect on this machine (the same preload the consumer gets).
    out = subprocess.run(["date", "+%s"], env=dict(os.environ, **SKEW), capture_output=True,
                         text=True, check=True).stdout
    assert abs(int(out) - (time.time() - 7200)) < 60, f"libfaketime had no effect: {out}"

    c = consumers("billing", queue, db, args=["--dedup-window", "1d", "--log-level", "debug"],
                  env=SKEW)
    # The consumer itself runs 2 h slow: its log lines carry its clock.
    first = c.log().splitlines()[0]
    logged = datetime.datetime.strptime(first[:19], "%Y-%m-%dT%H:%M:%S").replace(
        tzinfo=datetime.timezone.utc).timestamp()
    assert 7000 < time.time() - logged < 7400, f"the consumer's clock is not skewed: {first}"

    now = int(time.time())
    old_sub, young_sub = new_id(), new_id()
    old = broker.publish_event(TYPE, payload(subscription_id=old_sub), timestamp=now - 25 * 3600)
    young = broker.publish_event(TYPE, payload(subscription_id=young_sub),
                                 timestamp=now - 23 * 3600)
    dl = dead_letters(queue)
    wait_until(lambda: ("billing", young) in db.ledger("billing"), 15, 0.1,
               lambda: f"the 23 h old event applied\n{c.log()[-2000:]}")
    [d] = dl.wait(1)
    assert d.props.message_id == old, d
    assert (d.error or "").startswith("stale"), d.error
    assert db.ledger("billing") == [("billing", young)]
    assert db.dunning_step(young_sub) == 1
    assert db.dunning_step(old_sub) is None
    assert c.stop() == 0


def test_x_idem_seq_is_the_outbox_seq_increasing_per_subscription(db, servers, queue, broker):
    """(c) Every message carries x-idem-seq = its outbox row's seq (an integer), strictly
    increasing per subscription in the order the queue received them."""
    declare_consumer_queue(broker, queue, [TYPE])
    subs = [new_id() for _ in range(3)]
    events = [(TYPE, subs[i % 3], f"k{i}:{new_id()}", payload(subscription_id=subs[i % 3], n=i))
              for i in range(24)]
    ids = emit_many(db, events, per_tx=4)
    seqs = {i: r["seq"] for i, r in outbox(db).items()}
    r = relay_once(db, servers, "--batch", "5")
    assert r.returncode == 0, r.stderr

    got = read_queue(broker, queue, expect=len(ids))
    assert sorted(m.event_id for m in got) == sorted(ids)
    for m in got:
        v = m.headers.get("x-idem-seq")
        assert isinstance(v, int) and not isinstance(v, bool), (m, v)
        assert v == seqs[m.event_id], (m, v, seqs[m.event_id])
    for s in subs:
        per = [m.headers["x-idem-seq"] for m in got if m.sub == s]
        assert len(per) == 8
        assert all(a < b for a, b in zip(per, per[1:])), (s, per)
        assert [m.n for m in got if m.sub == s] == sorted(m.n for m in got if m.sub == s)
