"""A batch goes to PostgreSQL in one round trip: its claim, its handlers' statements and COMMIT
together, before the claim's answer is read; the claim fails the whole transaction unless every
id of the batch is new (idem_claim_check, SQLSTATE IDEM1), and the batch then goes again with
its claim read first. Up to two batches' COMMITs are on their way at once, each on its own
connection. These tests hold the consumer to exactly once through that path: batches mixing new
and already applied ids, a schema without the check function, a crash between a COMMIT and its
ack while another batch is in flight, and PostgreSQL terminating the consumer's connections
with batches in flight."""

import collections
import signal
import time

import pytest

from conftest import new_id, payload, wait_until


def publish_mixed(broker, subs, old, new_count):
    """Publishes the old (id, body) pairs again, interleaved with new_count new events over
    subs; returns the new pairs."""
    fresh = []
    for i in range(new_count):
        body = payload(subscription_id=subs[i % len(subs)])
        fresh.append((broker.publish_event("payment.failed", body), body))
        if i % 2 == 1 and old:
            eid, obody = old[(i // 2) % len(old)]
            broker.publish_event("payment.failed", obody, event_id=eid)
    return fresh


def steps_by_sub(events):
    return collections.Counter(body["subscription_id"] for _, body in events)


def queued(consumers, queue, db, broker, n, nsubs):
    """n events over nsubs subscriptions queued while nobody consumes (a consumer declared the
    queue and stopped); returns every (id, body)."""
    subs = [new_id() for _ in range(nsubs)]
    c0 = consumers("billing", queue, db)
    assert c0.stop() == 0
    return [(broker.publish_event("payment.failed", b), b)
            for b in (payload(subscription_id=subs[i % nsubs]) for i in range(n))]


def applied_then_mixed(consumers, queue, db, broker, subs, n_old, n_new, args=()):
    """A first consumer applies n_old events and stops; then n_new new events are queued with
    the old ones again between them, and a second consumer (args) drains all of them. Returns
    the first consumer, the second, and every (id, body) once."""
    c1 = consumers("billing", queue, db)
    first = [(broker.publish_event("payment.failed", b), b)
             for b in (payload(subscription_id=subs[i % len(subs)]) for i in range(n_old))]
    c1.wait_handled(n_old)
    assert c1.stop() == 0
    fresh = publish_mixed(broker, subs, first, n_new)
    assert broker.depth(queue) == n_old + n_new
    c2 = consumers("billing", queue, db, args=args)
    c2.wait_handled(n_old + n_new, timeout=60)
    assert c2.metric("idem_consumer_applied_total") == n_new
    assert c2.metric("idem_consumer_duplicates_total") == n_old
    assert c2.stop() == 0
    want = steps_by_sub(first + fresh)
    for sub in subs:
        assert db.dunning_step(sub) == want[sub], sub
    return c1, c2


def test_batch_with_applied_ids_applies_only_the_new_ones(db, queue, consumers, broker,
                                                          dead_letters):
    subs = [new_id() for _ in range(40)]
    # while nobody consumes: 200 new events, and each of 100 applied ones again between them
    _, c2 = applied_then_mixed(consumers, queue, db, broker, subs, 100, 200,
                               args=("--log-level", "debug"))
    assert db.count("idem.consumed_events") == 300
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []
    # the one-round-trip batches met ids that were not new and went again, claims read first
    assert "not all new" in c2.log()


def test_schema_without_the_check_function_reads_claims_first(db, queue, consumers, broker):
    """A database migrated before sql/007 (no idem_claim_check): the consumer says so and reads
    every claim before running handlers; still exactly once."""
    db.execute("DROP FUNCTION idem.idem_claim_check(bigint, integer)")
    subs = [new_id() for _ in range(10)]
    c1, c2 = applied_then_mixed(consumers, queue, db, broker, subs, 50, 100,
                                args=("--log-level", "debug"))
    assert "idem_claim_check is missing" in c1.log()
    assert "not all new" not in c2.log()  # no batch tried in one round trip
    assert "batch committed" in c2.log()


def test_crash_between_commit_and_ack_with_batches_in_flight(db, queue, consumers, broker):
    """SIGKILL when the third batch's COMMIT is answered, before its ack: the batch after it may
    be committing on the other connection. Everything comes again; each event applies once."""
    events = queued(consumers, queue, db, broker, 600, 500)

    c1 = consumers("billing", queue, db, fault="consumer.after_commit:3", start=False)
    c1.start(wait_ready=False)  # the queue is full: it may die before it looks ready
    assert c1.wait_exit(30) == -signal.SIGKILL
    committed = db.count("idem.consumed_events")
    assert committed >= 3, committed  # at least the three batches whose COMMIT was answered

    c2 = consumers("billing", queue, db)
    wait_until(lambda: db.count("idem.consumed_events") == 600 or None, 60, 0.2, "600 claims")
    c2.wait_handled(600 - committed + 1, timeout=30)
    wait_until(lambda: broker.depth(queue) == 0 or None, 30, 0.2, "the queue drained")
    assert c2.stop() == 0
    want = steps_by_sub(events)
    got = dict(db.query("SELECT subscription_id::text, step FROM billing.dunning"))
    assert got == dict(want)


@pytest.mark.slow
def test_connections_terminated_with_batches_in_flight(db, queue, consumers, broker):
    """PostgreSQL ends every connection of the consumer, again and again, while it drains a full
    queue with batches in flight on both: outcomes unknown, nothing acked before a known COMMIT,
    each event applied once."""
    events = queued(consumers, queue, db, broker, 3000, 300)
    dbname = db.scalar("SELECT current_database()")
    c = consumers("billing", queue, db, start=False)
    c.start(wait_ready=False)
    kills, deadline = 0, time.monotonic() + 20
    while db.count("idem.consumed_events") < 3000 and time.monotonic() < deadline:
        kills += db.scalar("SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM "
                           "pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
                           "AND backend_type = 'client backend') k", dbname)
        time.sleep(0.03)
    assert kills > 0
    wait_until(lambda: db.count("idem.consumed_events") == 3000 or None, 90, 0.2, "3000 claims")
    wait_until(lambda: broker.depth(queue) == 0 or None, 60, 0.2, "the queue drained")
    assert c.stop() == 0
    assert "paused (SQLSTATE" in c.log()
    got = dict(db.query("SELECT subscription_id::text, step FROM billing.dunning"))
    assert got == dict(steps_by_sub(events))
