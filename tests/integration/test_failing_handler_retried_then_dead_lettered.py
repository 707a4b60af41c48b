"""A failing handler leaves no claim and no partial effect. A transient failure (SQLSTATE 40001)
is retried --max-retries times and then dead-lettered as retries_exhausted; any other error is
dead-lettered at once as handler_rejected. Once the cause is gone, new events apply normally."""

import json
import time

from conftest import new_id, payload

FAIL_FN = """
CREATE FUNCTION it_fail() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'it_fail: injected by the test' USING ERRCODE = '{code}';
END $$;
CREATE TRIGGER it_fail BEFORE INSERT OR UPDATE ON {table}
    FOR EACH ROW EXECUTE FUNCTION it_fail();
"""


def inject_failure(db, table, code):
    db.execute(FAIL_FN.format(table=table, code=code))


def remove_failure(db, table):
    db.execute(f"DROP TRIGGER it_fail ON {table}; DROP FUNCTION it_fail()")


def test_transient_failure_retried_then_retries_exhausted(db, queue, consumers, broker,
                                                          dead_letters):
    inject_failure(db, "billing.dunning", "40001")
    c = consumers("billing", queue, db, args=["--max-retries", "2"])
    body = payload()
    eid = new_id()
    raw = json.dumps(body).encode()
    t0 = time.monotonic()
    broker.publish_event("payment.failed", raw, event_id=eid, headers={"x-trace": "t-1"})

    dl = dead_letters(queue).wait(1, timeout=20)
    elapsed = time.monotonic() - t0
    assert len(dl) == 1
    d = dl[0]
    assert d.error.startswith("retries_exhausted: "), d.error
    assert d.body == raw
    assert d.props.message_id == eid
    assert d.props.type == "payment.failed"
    assert d.header("x-trace") == "t-1"
    # First try + 2 retries, waiting 1 s then 2 s in between.
    assert c.metric("idem_consumer_handler_errors_total") == 3
    assert c.metric("idem_consumer_dead_lettered_total", code="retries_exhausted") == 1
    assert elapsed >= 2.5, f"dead-lettered after {elapsed:.1f}s: retries did not wait 1 s + 2 s"

    # No claim, no effect.
    assert db.count("billing.dunning") == 0
    assert db.ledger() == []

    # The cause is gone: a new event is applied normally.
    remove_failure(db, "billing.dunning")
    e2 = broker.publish_event("payment.failed", payload(subscription_id=body["subscription_id"]))
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", e2)]
    assert broker.depth(queue) == 0
    assert dead_letters(queue).poll() == []


def test_transient_failure_that_clears_is_applied_once(db, queue, consumers, broker, dead_letters):
    """A failure that clears while the message is retried: applied once, nothing dead-lettered."""
    inject_failure(db, "billing.dunning", "40P01")
    c = consumers("billing", queue, db, args=["--max-retries", "3"])
    body = payload()
    eid = broker.publish_event("payment.failed", body)
    c.wait_metric("idem_consumer_handler_errors_total", 1)
    remove_failure(db, "billing.dunning")
    c.wait_metric("idem_consumer_applied_total", 1, timeout=20)
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    assert dead_letters(queue).poll() == []
    assert broker.depth(queue) == 0


def test_non_transient_failure_dead_lettered_at_once(db, queue, consumers, broker, dead_letters):
    inject_failure(db, "billing.dunning", "P0001")  # a plain RAISE EXCEPTION
    c = consumers("billing", queue, db, args=["--max-retries", "5"])
    body = payload()
    raw = json.dumps(body).encode()
    eid = broker.publish_event("payment.failed", raw)

    # With 5 retries a retried message would take 31 s to come out: at once means no retry.
    dl = dead_letters(queue).wait(1, timeout=10)
    d = dl[0]
    assert d.error.startswith("handler_rejected: "), d.error
    assert d.body == raw and d.props.message_id == eid
    assert c.metric("idem_consumer_handler_errors_total") == 1
    assert c.metric("idem_consumer_dead_lettered_total", code="handler_rejected") == 1
    assert db.count("billing.dunning") == 0
    assert db.ledger() == []

    remove_failure(db, "billing.dunning")
    e2 = broker.publish_event("payment.failed", body)
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", e2)]


def test_check_violation_is_rejected_without_partial_effect(db, queue, consumers, broker,
                                                            dead_letters):
    """invoice.paid writes revenue_entries, then emits its follow-up into the outbox. Failing the
    outbox insert (23514) must roll back the revenue row too: no partial effect, no claim."""
    inject_failure(db, "idem.event_outbox", "23514")
    c = consumers("revenue", queue, db, args=["--bind", "invoice.paid", "--max-retries", "5"])
    body = payload()
    eid = broker.publish_event("invoice.paid", body)
    dl = dead_letters(queue).wait(1, timeout=10)
    assert dl[0].error.startswith("handler_rejected: "), dl[0].error
    assert dl[0].props.message_id == eid
    assert db.count("billing.revenue_entries") == 0
    assert db.count("idem.event_outbox") == 0
    assert db.ledger() == []

    remove_failure(db, "idem.event_outbox")
    body2 = payload()
    e2 = broker.publish_event("invoice.paid", body2)
    c.wait_metric("idem_consumer_applied_total", 1)
    assert c.stop() == 0
    assert db.query("SELECT invoice_id::text FROM billing.revenue_entries") == [(body2["invoice_id"],)]
    assert db.count("idem.event_outbox", "event_type = 'receipt.requested'") == 1
    assert db.ledger() == [("revenue", e2)]


def test_failing_event_does_not_block_its_batch_mates(db, queue, consumers, broker, dead_letters):
    """Good events around a rejected one (likely in one batch) are all applied exactly once."""
    db.execute("""
        CREATE FUNCTION it_fail_one() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.subscription_id = '00000000-0000-4000-8000-00000000bad0' THEN
                RAISE EXCEPTION 'it_fail_one: injected by the test';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER it_fail_one BEFORE INSERT OR UPDATE ON billing.dunning
            FOR EACH ROW EXECUTE FUNCTION it_fail_one();
    """)
    # Published while no consumer runs, so that they arrive together: a first run declares and
    # binds the queue.
    assert consumers("billing", queue, db).stop() == 0
    c = consumers("billing", queue, db, start=False)
    good_sub = new_id()
    ids = []
    for i in range(5):
        ids.append(broker.publish_event("payment.failed", payload(subscription_id=good_sub)))
        if i == 2:
            bad = broker.publish_event(
                "payment.failed", payload(subscription_id="00000000-0000-4000-8000-00000000bad0"))
    c.start()
    dl = dead_letters(queue).wait(1, timeout=10)
    c.wait_metric("idem_consumer_applied_total", 5)
    assert c.stop() == 0
    assert [d.props.message_id for d in dl] == [bad]
    assert dl[0].error.startswith("handler_rejected: ")
    assert db.dunning_step(good_sub) == 5
    assert db.ledger("billing") == sorted(("billing", i) for i in ids)
    assert broker.depth(queue) == 0
