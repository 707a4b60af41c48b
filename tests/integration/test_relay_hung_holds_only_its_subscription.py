"""A relay that hangs (SIGSTOP, as in a VM pause) while it holds a subscription's rows holds back
that subscription only, however long its backlog (CONTRACT.md, "Failure policy (relay)").

Subscription H has 5,000 pending rows, older than everything else. A relay claims a batch of H
and is frozen while it holds H's first pending row. A second relay must then publish 60 events of
20 other subscriptions, emitted after the freeze, within 20 s, and none of H's. Afterwards H's
events reach the queue complete and in emit order: with the frozen relay resumed (SIGCONT) each
exactly once, with `x-idem-seq` strictly increasing; with it killed (SIGKILL) the first
occurrences (its batch may go out twice: confirmed, never marked).

Before the claim picked work by subscription heads, the claim looked at the oldest batch x 16
due rows only: all of them H's, whose lock the frozen relay held, so nothing else went out."""

import signal
import time

import pytest

from conftest import new_id, payload, wait_until
from relay_helpers import declare_consumer_queue, emit_many, read_queue, relay_daemons, status_counts

__all__ = ["relay_daemons"]

TYPE = "payment.failed"
HELD_ROWS = 5000
OTHERS = 20
PER_OTHER = 3
FLOW_BOUND_S = 20
# The freeze lasts well under the relay's confirm timeout (30 s) and heartbeat (30 s): resumed,
# the frozen relay carries on with its batch as it was.
RELAY = ("--poll-interval", "50ms")

# Rows of one subscription in one statement, payload field "n" = first..last in emit order.
EMIT_SERIES = """
SELECT count(idem.idem_emit(%s, x.s, x.s::text || ':' || i,
                       jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id',
                                          x.s, 'amount_cents', 100, 'currency', 'USD', 'n', i)))
  FROM (SELECT %s::uuid AS s) x CROSS JOIN generate_series(%s, %s) AS i"""

# H's first pending row, and the first one nobody holds locked (they differ while a relay holds
# H); rolled back at once.
HEAD = ("SELECT seq FROM idem.event_outbox WHERE subscription_id = %s AND status = 'pending'"
        " ORDER BY seq LIMIT 1")
FREE_HEAD = HEAD + " FOR UPDATE SKIP LOCKED"


def held(db, sub):
    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute(HEAD, (sub,))
        head = cur.fetchone()
        cur.execute(FREE_HEAD, (sub,))
        free = cur.fetchone()
        conn.rollback()
    return head is not None and free != head


def sent_of(db, sub):
    return db.count("idem.event_outbox", "subscription_id = %s AND status = 'sent'", sub)


def freeze_holding(relay, db, sub):
    """SIGSTOP relay at a moment it holds sub's first pending row (else resume, try again)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        relay.pause()
        time.sleep(0.1)  # what it sent before the stop has reached the server
        if held(db, sub):
            return
        relay.resume()
        time.sleep(0.02)
    raise AssertionError(f"{relay.name} was never caught holding {sub}:\n{relay.log()[-3000:]}")


def by_sub(msgs):
    out = {}
    for m in msgs:
        out.setdefault(m.sub, []).append(m)
    return out


def first_occurrences(ns):
    seen, out = set(), []
    for n in ns:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def emit_others(db):
    """PER_OTHER events for each of OTHERS new subscriptions, one transaction each."""
    others = [new_id() for _ in range(OTHERS)]
    emit_many(db, [(TYPE, s, f"{s}:{n}", payload(subscription_id=s, n=n))
                   for n in range(1, PER_OTHER + 1) for s in others], per_tx=1)
    return others


def others_sent(db, held_sub):
    return db.count("idem.event_outbox", "status = 'sent' AND subscription_id <> %s", held_sub)


def run_freeze(db, queue, broker, relay_daemons):
    """H's backlog, relay1 frozen holding H, relay2 publishing the others. Returns (hung, others,
    relay1, relay2, H's sent rows at the freeze)."""
    declare_consumer_queue(broker, queue, [TYPE])
    hung = new_id()
    assert db.scalar(EMIT_SERIES, TYPE, hung, 1, HELD_ROWS) == HELD_ROWS
    relay1 = relay_daemons(RELAY, name="relay1-frozen")
    wait_until(lambda: sent_of(db, hung) > 0, 20, 0.01, "relay1 publishing H", [relay1])
    freeze_holding(relay1, db, hung)
    at_freeze = sent_of(db, hung)
    pending = db.count("idem.event_outbox", "subscription_id = %s AND status = 'pending'", hung)
    assert pending > 4000, f"H must keep a long backlog behind the frozen batch: {pending}"

    relay2 = relay_daemons(RELAY, name="relay2")
    relay2.wait_ready()
    others = emit_others(db)
    total = OTHERS * PER_OTHER
    t0 = time.monotonic()
    wait_until(lambda: others_sent(db, hung) == total, FLOW_BOUND_S, 0.05,
               lambda: f"the {total} events of other subscriptions published while relay1 is "
                       f"frozen holding H (now {status_counts(db)})", [relay2])
    took = time.monotonic() - t0
    assert held(db, hung), "relay1 let go of H while frozen"
    assert sent_of(db, hung) == at_freeze, "H's rows went out while its head was held"
    print(f"{total} events of other subscriptions published in {took:.2f}s beside the frozen "
          f"relay")
    return hung, others, relay1, relay2, at_freeze


def check_others(msgs, others):
    got = by_sub(msgs)
    for s in others:
        assert [m.n for m in got.get(s, [])] == list(range(1, PER_OTHER + 1)), s


@pytest.mark.slow  # a 5,000-row subscription behind a frozen relay: 10-60 s
def test_frozen_relay_holds_only_its_subscription_then_resumes_in_order(db, servers, queue,
                                                                        broker, relay_daemons):
    hung, others, relay1, relay2, _ = run_freeze(db, queue, broker, relay_daemons)
    relay1.resume()
    total = HELD_ROWS + OTHERS * PER_OTHER
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == total, 60, 0.1,
               lambda: f"every row sent (now {status_counts(db)})", [relay1, relay2])
    msgs = read_queue(broker, queue, expect=total, timeout=60)
    assert relay1.stop() == 0
    assert relay2.stop() == 0

    assert len(msgs) == total, f"{len(msgs)} messages for {total} events: duplicates or losses"
    check_others(msgs, others)
    mine = by_sub(msgs)[hung]
    assert [m.n for m in mine] == list(range(1, HELD_ROWS + 1)), "H out of emit order"
    seqs = [int(m.headers["x-idem-seq"]) for m in mine]
    assert all(a < b for a, b in zip(seqs, seqs[1:])), "x-idem-seq of H not strictly increasing"


@pytest.mark.slow  # a 5,000-row subscription behind a frozen relay: 10-60 s
def test_frozen_relay_killed_its_subscription_goes_on_in_order(db, servers, queue, broker,
                                                               relay_daemons):
    hung, others, relay1, relay2, at_freeze = run_freeze(db, queue, broker, relay_daemons)
    relay1.kill()  # SIGKILL while stopped: its server session ends, its batch rolls back
    assert relay1.returncode == -signal.SIGKILL
    total = HELD_ROWS + OTHERS * PER_OTHER
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == total, 60, 0.1,
               lambda: f"every row sent by relay2 (now {status_counts(db)})", [relay2])
    msgs = read_queue(broker, queue, expect=total, timeout=60)
    assert relay2.stop() == 0

    check_others(msgs, others)
    ns = [m.n for m in by_sub(msgs)[hung]]
    assert first_occurrences(ns) == list(range(1, HELD_ROWS + 1)), "H out of emit order"
    # Only the frozen relay's unmarked batches go out twice (at most four batches of 200).
    assert len(ns) - HELD_ROWS <= 800, f"{len(ns) - HELD_ROWS} duplicates"
    # What relay1 had marked sent before the freeze does not go out again.
    assert sum(1 for n in ns if n <= at_freeze) == at_freeze


def test_head_waiting_for_a_retry_holds_only_its_long_backlog(db, servers, queue, broker,
                                                              relay_daemons):
    """The same shape with the head of the 5,000-row subscription waiting for a retry (its type
    is bound to no queue: returned, an attempt spent, a minute's backoff): the other
    subscriptions flow, and nothing behind the waiting head goes out."""
    declare_consumer_queue(broker, queue, [TYPE])
    held_sub = new_id()
    emit_many(db, [("unbound.type", held_sub, f"{held_sub}:0", payload(subscription_id=held_sub,
                                                                         n=0))])
    assert db.scalar(EMIT_SERIES, TYPE, held_sub, 1, HELD_ROWS) == HELD_ROWS
    relay = relay_daemons((*RELAY, "--backoff-base", "60s", "--backoff-max", "60s"))
    head = "subscription_id = %s AND (payload->>'n')::int = 0 AND attempts = 1"
    wait_until(lambda: db.count("idem.event_outbox", head, held_sub) == 1, 20, 0.05,
               "the held subscription's head returned once", [relay])
    others = emit_others(db)
    total = OTHERS * PER_OTHER
    wait_until(lambda: others_sent(db, held_sub) == total, FLOW_BOUND_S, 0.05,
               lambda: f"the {total} events of other subscriptions published while the head "
                       f"of a 5,000-row subscription waits for its retry (now "
                       f"{status_counts(db)})", [relay])
    msgs = read_queue(broker, queue, expect=total)
    assert relay.stop() == 0
    check_others(msgs, others)
    assert sent_of(db, held_sub) == 0, "rows went out behind a head waiting for its retry"
    assert db.count("idem.event_outbox", "subscription_id = %s AND status = 'pending' AND attempts = 0",
                    held_sub) == HELD_ROWS
    assert db.count("idem.event_outbox", head, held_sub) == 1
