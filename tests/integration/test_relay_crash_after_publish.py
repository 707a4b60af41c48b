"""The relay killed between the broker's confirm and mark-sent (IDEM_FAULT=relay.after_publish):
the rows stay pending with no attempt spent, the next run publishes them again (the queue then
holds every event twice) and marks them sent, and the consumer applies each event once."""

import signal

from conftest import new_id, payload, wait_until
from relay_helpers import declare_consumer_queue, emit_many, outbox, relay_once

TYPES = ("payment.failed", "invoice.paid", "receipt.requested")  # the consumer's default binds


def test_crash_after_publish_republished_and_applied_once(db, servers, queue, broker, consumers,
                                                          dead_letters):
    declare_consumer_queue(broker, queue, TYPES)
    subs = [new_id() for _ in range(3)]
    per_sub = {subs[0]: 1, subs[1]: 2, subs[2]: 3}
    events = [("payment.failed", s, f"pf:{s}:{i}", payload(subscription_id=s))
              for s, k in per_sub.items() for i in range(k)]
    ids = emit_many(db, events)
    n = len(ids)

    # 1. Killed after the confirms, before the mark-sent commit.
    r = relay_once(db, servers, fault="relay.after_publish")
    assert r.returncode == -signal.SIGKILL, f"rc={r.returncode}\n{r.stdout}{r.stderr}"
    rows = outbox(db)
    assert sorted(rows) == sorted(ids)
    assert {(v["status"], v["attempts"]) for v in rows.values()} == {("pending", 0)}, rows
    # ... but the broker has them (confirmed means queued).
    wait_until(lambda: broker.depth(queue) == n, 10, 0.1,
               lambda: f"{n} messages in {queue} (have {broker.depth(queue)})")

    # 2. The next run publishes them again and marks them sent.
    r = relay_once(db, servers)
    assert r.returncode == 0, r.stderr
    rows = outbox(db)
    assert {(v["status"], v["attempts"]) for v in rows.values()} == {("sent", 0)}, rows
    wait_until(lambda: broker.depth(queue) == 2 * n, 10, 0.1,
               lambda: f"{2 * n} messages in {queue} (have {broker.depth(queue)})")

    # 3. The consumer absorbs the duplicates.
    c = consumers("billing", queue, db)
    c.wait_handled(2 * n)
    assert c.metric("idem_consumer_applied_total") == n
    assert c.metric("idem_consumer_duplicates_total") == n
    assert c.stop() == 0

    for s, k in per_sub.items():
        assert db.dunning_step(s) == k, f"subscription {s}: expected step {k}"
    assert db.ledger() == sorted(("billing", i) for i in ids)
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


def test_fault_counts_batches(db, servers, queue, broker):
    """relay.after_publish:2 with --batch 2: the first batch is committed sent, the second is
    published and left pending, the rest untouched; the next run finishes without the fault."""
    declare_consumer_queue(broker, queue, TYPES)
    sub = new_id()
    ids = emit_many(db, [("payment.failed", sub, f"pf:{sub}:{i}", payload(subscription_id=sub))
                         for i in range(5)])
    r = relay_once(db, servers, "--batch", "2", fault="relay.after_publish:2")
    assert r.returncode == -signal.SIGKILL, f"rc={r.returncode}\n{r.stderr}"
    rows = outbox(db)
    assert [rows[i]["status"] for i in ids] == ["sent", "sent", "pending", "pending", "pending"]
    assert all(v["attempts"] == 0 for v in rows.values())
    wait_until(lambda: broker.depth(queue) == 4, 10, 0.1, "4 messages published")

    r = relay_once(db, servers, "--batch", "2")
    assert r.returncode == 0, r.stderr
    assert {v["status"] for v in outbox(db).values()} == {"sent"}
    wait_until(lambda: broker.depth(queue) == 7, 10, 0.1, "7 messages (2 republished)")
