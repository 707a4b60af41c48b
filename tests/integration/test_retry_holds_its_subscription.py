"""A delivery waiting for a retry holds the later events of its subscription.

payment.failed then invoice.paid for subscription S: the first try(s) of payment.failed fail with
SQLSTATE 40001 (a Retry). The invoice.paid behind it must wait until payment.failed is applied, so
that S ends at dunning step 0 (failed, then paid). An event of another subscription T, delivered
after them, is applied while S waits (other subscriptions are not held), and the held invoice.paid
is applied exactly once (one revenue entry, one receipt.requested in the outbox).

Without the hold, invoice.paid would overtake the retrying payment.failed: it would find no
dunning row to reset, and the late payment.failed would leave S at step 1, dunning a customer who
has paid. Without the per-subscription scope, one retrying event would stall every subscription.

The failure is switched on and off by the test (a flag read by a trigger on dunning) rather than
"only the first time": a first failure inside a shared batch is not a counted try (the batch is
redone one delivery at a time), so a one-shot failure could be spent there and the retry, and
with it the hold, would never happen. A sequence counts the failed statements.
"""

import pytest

from conftest import new_id, payload, wait_until
from consumer_helpers import add_failure


@pytest.fixture
def switchable_40001(db):
    """40001 on inserting S's dunning row while it_ctl.fail is true. Returns (S, set_fail)."""
    sub = new_id()
    db.execute("CREATE TABLE it_ctl (fail boolean NOT NULL); INSERT INTO it_ctl VALUES (true);"
               "CREATE SEQUENCE it_tries")
    add_failure(db, "billing.dunning", "40001", events="INSERT",
                condition=f"NEW.subscription_id = '{sub}' AND (SELECT fail FROM it_ctl)"
                          " AND nextval('it_tries') > 0")

    def set_fail(on):
        db.execute("UPDATE it_ctl SET fail = %s", on)

    return sub, set_fail


def applied_once(db, consumer_name, events):
    assert db.ledger() == sorted((consumer_name, e) for e in events)


def check_held(db, sub, paid_body):
    """While payment.failed of sub is retrying: nothing of sub applied, invoice.paid not either."""
    assert db.dunning_step(sub) is None
    assert db.count("billing.revenue_entries", "invoice_id = %s", paid_body["invoice_id"]) == 0
    assert db.count("idem.event_outbox", "event_type = 'receipt.requested'") == 0


def check_final(db, sub, paid_body, other_sub):
    assert db.dunning_step(sub) == 0, "invoice.paid overtook the retrying payment.failed"
    assert db.dunning_step(other_sub) == 1
    assert db.count("billing.revenue_entries", "invoice_id = %s", paid_body["invoice_id"]) == 1
    assert db.count("idem.event_outbox", "event_type = 'receipt.requested'") == 1


def test_retry_holds_later_events_of_its_subscription(db, queue, consumers, broker, dead_letters,
                                                      switchable_40001):
    sub, set_fail = switchable_40001
    c = consumers("billing", queue, db, args=["--bind", "payment.failed", "--bind",
                                             "invoice.paid", "--max-retries", "5"])
    failed = broker.publish_event("payment.failed", payload(subscription_id=sub))
    c.wait_metric("idem_consumer_handler_errors_total", 1)
    # payment.failed is now waiting for its retry (1 s, then 2 s, ...: the failure stays on).
    paid_body = payload(subscription_id=sub)
    paid = broker.publish_event("invoice.paid", paid_body)
    other_sub = new_id()
    other = broker.publish_event("payment.failed", payload(subscription_id=other_sub))

    # The other subscription is not held: applied while S still fails.
    wait_until(lambda: db.dunning_step(other_sub) == 1, 10, what="T's event applied")
    check_held(db, sub, paid_body)
    # At least one more failed try of payment.failed, and invoice.paid still waits behind it.
    c.wait_metric("idem_consumer_handler_errors_total", 2, timeout=10)
    check_held(db, sub, paid_body)
    assert c.metric("idem_consumer_applied_total") == 1

    set_fail(False)
    c.wait_metric("idem_consumer_applied_total", 3, timeout=15)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.stop() == 0
    check_final(db, sub, paid_body, other_sub)
    applied_once(db, "billing", [failed, paid, other])
    assert db.scalar("SELECT last_value FROM it_tries") >= 2
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0


def test_retry_in_a_shared_batch_holds_later_events_of_its_subscription(db, queue, consumers,
                                                                       broker, dead_letters,
                                                                       switchable_40001):
    """The same when all three arrive in one batch: the batch fails, is redone one by one, and
    the one-by-one pass must skip invoice.paid behind the payment.failed that now waits."""
    sub, set_fail = switchable_40001
    args = ["--bind", "payment.failed", "--bind", "invoice.paid", "--max-retries", "5"]
    assert consumers("billing", queue, db, args=args).stop() == 0  # declares and binds
    c = consumers("billing", queue, db, args=args, start=False)
    failed = broker.publish_event("payment.failed", payload(subscription_id=sub))
    paid_body = payload(subscription_id=sub)
    paid = broker.publish_event("invoice.paid", paid_body)
    other_sub = new_id()
    other = broker.publish_event("payment.failed", payload(subscription_id=other_sub))
    c.start()

    wait_until(lambda: db.dunning_step(other_sub) == 1, 10, what="T's event applied")
    check_held(db, sub, paid_body)
    c.wait_metric("idem_consumer_handler_errors_total", 2, timeout=10)
    check_held(db, sub, paid_body)

    set_fail(False)
    c.wait_metric("idem_consumer_applied_total", 3, timeout=15)
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.stop() == 0
    check_final(db, sub, paid_body, other_sub)
    applied_once(db, "billing", [failed, paid, other])
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0
