"""A batch never waits forever behind an application's lock.

An application transaction holds SELECT ... FOR UPDATE on the dunning row of subscription S for
about 6 s. The consumer runs with --lock-timeout 1s: its transaction for S's event gives up after
1 s with SQLSTATE 55P03 (lock_not_available), a Retry-class failure, so the event waits in memory
for its retry instead of blocking the consumer. An event of another subscription T published
meanwhile is applied within 3 s. Once the lock is released, S's event is applied exactly once
(--max-retries 5: retry delays 1 + 2 + 4 s outlast the lock).

Without a lock timeout, one long application transaction (a report, a stuck session, a
migration) would freeze every subscription the consumer serves, for as long as it lasts.
"""

import time

from conftest import new_id, payload, wait_until
from consumer_helpers import log_lines

HOLD_S = 6.0


def test_lock_timeout_bounds_a_batch(db, queue, consumers, broker, dead_letters):
    sub = new_id()
    db.execute("INSERT INTO billing.dunning (subscription_id, step) VALUES (%s, 1)", sub)
    c = consumers("billing", queue, db, args=["--lock-timeout", "1s", "--max-retries", "5"])

    with db.connect(autocommit=False) as app:
        with app.cursor() as cur:
            cur.execute("SELECT step FROM billing.dunning WHERE subscription_id = %s FOR UPDATE", (sub,))
        t_lock = time.monotonic()
        held = broker.publish_event("payment.failed", payload(subscription_id=sub))
        # First try: 1 s waiting for the lock, then 55P03.
        c.wait_metric("idem_consumer_handler_errors_total", 1, timeout=5)
        assert db.dunning_step(sub) == 1

        other_sub = new_id()
        t_pub = time.monotonic()
        other = broker.publish_event("payment.failed", payload(subscription_id=other_sub))
        wait_until(lambda: db.dunning_step(other_sub) == 1, 10, 0.05, "T's event applied")
        took = time.monotonic() - t_pub
        assert took < 3.0, f"T's event took {took:.1f}s: it waited behind S's lock"
        assert db.dunning_step(sub) == 1, "S's event applied through the application's lock?"
        assert ("billing", held) not in db.ledger()

        # The application's transaction ends after about HOLD_S seconds.
        left = HOLD_S - (time.monotonic() - t_lock)
        if left > 0:
            time.sleep(left)
        assert db.dunning_step(sub) == 1
        app.commit()

    c.wait_metric("idem_consumer_applied_total", 2, timeout=15)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    tries = c.metric("idem_consumer_handler_errors_total")
    assert tries >= 2, "the lock outlasted a single timeout: there must be retries"
    assert log_lines(c, r"try \d+ failed.*55P03"), c.log()[-3000:]
    assert c.stop() == 0
    assert db.dunning_step(sub) == 2
    assert db.dunning_step(other_sub) == 1
    assert db.ledger() == sorted(("billing", e) for e in (held, other))
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0
    print(f"T applied {took:.2f}s after its publish; S failed {tries:.0f} tries")


def test_lock_timeout_bounds_a_shared_batch(db, queue, consumers, broker, dead_letters):
    """S's event arrives in one batch with events of other subscriptions: the batch's transaction
    gives up after 1 s, the batch is redone one by one, S's event waits for its retry and the
    others are applied, all within 3 s of the consumer's start."""
    sub = new_id()
    db.execute("INSERT INTO billing.dunning (subscription_id, step) VALUES (%s, 1)", sub)
    args = ["--lock-timeout", "1s", "--max-retries", "5"]
    assert consumers("billing", queue, db, args=args).stop() == 0  # declares and binds
    c = consumers("billing", queue, db, args=args, start=False)
    others = [new_id() for _ in range(4)]

    with db.connect(autocommit=False) as app:
        with app.cursor() as cur:
            cur.execute("SELECT step FROM billing.dunning WHERE subscription_id = %s FOR UPDATE", (sub,))
        t_lock = time.monotonic()
        ids = [broker.publish_event("payment.failed", payload(subscription_id=s))
               for s in others[:2]]
        held = broker.publish_event("payment.failed", payload(subscription_id=sub))
        ids += [broker.publish_event("payment.failed", payload(subscription_id=s))
                for s in others[2:]]
        c.start()
        t_start = time.monotonic()
        wait_until(lambda: all(db.dunning_step(s) == 1 for s in others), 10, 0.05,
                   "the other subscriptions' events applied")
        took = time.monotonic() - t_start
        assert took < 3.0, f"the others took {took:.1f}s: they waited behind S's lock"
        assert db.dunning_step(sub) == 1
        left = HOLD_S - (time.monotonic() - t_lock)
        if left > 0:
            time.sleep(left)
        app.commit()

    c.wait_metric("idem_consumer_applied_total", 5, timeout=15)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.stop() == 0
    assert db.dunning_step(sub) == 2
    assert db.ledger() == sorted(("billing", e) for e in ids + [held])
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0
    print(f"others applied {took:.2f}s after the start")
