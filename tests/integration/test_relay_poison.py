"""A poison (unroutable) event: every publish is returned (mandatory), each return spends an
attempt with backoff, and after --max-attempts the row parks as 'failed' with the reason. Other
subscriptions flow meanwhile. A later row of the poison row's own subscription waits while the
poison row is retrying and flows once it is parked (README: a parked row does not block its
subscription; a row waiting for a retry does)."""

import time

from conftest import new_id, payload, wait_until
from relay_helpers import (declare_consumer_queue, emit, emit_many, idem, outbox, read_queue,
                           relay_daemons, relay_once)

__all__ = ["relay_daemons"]

POISON_TYPE = "no.such.route"
FAST = ("--max-attempts", "3", "--backoff-base", "10ms", "--backoff-max", "50ms")


def test_poison_row_parks_while_other_subscriptions_flow(db, servers, queue, broker,
                                                         relay_daemons):
    declare_consumer_queue(broker, queue, ["payment.failed"])
    poison_sub = new_id()
    others = [new_id() for _ in range(5)]
    events = [("payment.failed", s, f"before:{s}", payload(subscription_id=s)) for s in others]
    events.append((POISON_TYPE, poison_sub, f"poison:{poison_sub}",
                   payload(subscription_id=poison_sub)))
    events += [("payment.failed", s, f"after:{s}:{i}", payload(subscription_id=s))
               for i in range(3) for s in others]
    ids = emit_many(db, events, per_tx=1)
    poison = ids[len(others)]
    good = [i for i in ids if i != poison]

    relay_daemons(FAST)
    wait_until(lambda: outbox(db)[poison]["status"] == "failed", 15, 0.05,
               lambda: f"the poison row parked (now {outbox(db)[poison]})")
    rows = outbox(db)
    p = rows[poison]
    assert p["attempts"] == 3, p
    assert "unroutable" in (p["last_error"] or ""), p
    assert p["sent_at"] is None
    wait_until(lambda: all(outbox(db)[i]["status"] == "sent" for i in good), 10, 0.05,
               "every routable row sent")
    assert all(outbox(db)[i]["attempts"] == 0 for i in good)

    got = read_queue(broker, queue, expect=len(good))
    assert sorted(m.event_id for m in got) == sorted(good)

    # It stays parked: a while later, still 3 attempts, still failed.
    time.sleep(0.5)
    assert (outbox(db)[poison]["status"], outbox(db)[poison]["attempts"]) == ("failed", 3)

    # `idem failed --json` lists it (the operator's view of parked rows).
    r = idem(db, servers, "failed", "--json")
    assert r.returncode == 0, r.stderr
    assert poison in r.stdout and not any(i in r.stdout for i in good)


AUDIT = """
CREATE TABLE outbox_audit (
    id       bigserial PRIMARY KEY,
    event_id uuid NOT NULL,
    status   text NOT NULL,
    attempts int  NOT NULL
);
CREATE FUNCTION outbox_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_audit (event_id, status, attempts)
    VALUES (NEW.event_id, NEW.status, NEW.attempts);
    RETURN NEW;
END $$;
CREATE TRIGGER outbox_audit AFTER UPDATE ON idem.event_outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_audit();
"""


def audit(db):
    """[(event_id, status, attempts)] of every update of an outbox row, in the order made."""
    return [tuple(r) for r in db.query(
        "SELECT event_id::text, status, attempts FROM outbox_audit ORDER BY id")]


def wait_due(db, event_id, timeout=10):
    wait_until(lambda: db.scalar("SELECT next_attempt_at <= now() FROM idem.event_outbox"
                                 " WHERE event_id = %s", event_id), timeout, 0.02,
               "the poison row due again")


def test_same_subscription_waits_behind_retrying_poison_then_flows(db, servers, queue, broker):
    # The test's database records every update of an outbox row (status, attempts) in order,
    # so that "the later row was published only after the poison row parked" can be checked
    # exactly, whatever a single relay run did in between.
    db.execute(AUDIT)
    declare_consumer_queue(broker, queue, ["payment.failed"])
    sub, other = new_id(), new_id()
    poison = emit(db, POISON_TYPE, sub, f"poison:{sub}", payload(subscription_id=sub, n=1))
    o1 = emit(db, "payment.failed", other, f"o1:{other}", payload(subscription_id=other))

    # First attempt: returned; the row waits 1 s before its next attempt (base 1s).
    r = relay_once(db, servers, "--max-attempts", "3", "--backoff-base", "1s",
                   "--backoff-max", "1s")
    assert r.returncode == 0, r.stderr
    rows = outbox(db)
    assert (rows[poison]["status"], rows[poison]["attempts"]) == ("pending", 1), rows[poison]
    assert "unroutable" in rows[poison]["last_error"]
    assert rows[o1]["status"] == "sent", "another subscription must not wait for the poison row"

    # A routable row of the same subscription, emitted after the poison row, and one of another
    # subscription: while the poison row waits for its retry, the first waits, the second flows.
    later = emit(db, "payment.failed", sub, f"later:{sub}", payload(subscription_id=sub, n=2))
    o2 = emit(db, "payment.failed", other, f"o2:{other}", payload(subscription_id=other))
    r = relay_once(db, servers, *FAST)
    assert r.returncode == 0, r.stderr
    rows = outbox(db)
    assert rows[later]["seq"] > rows[poison]["seq"]
    assert (rows[later]["status"], rows[later]["attempts"]) == ("pending", 0), rows[later]
    assert rows[o2]["status"] == "sent"
    assert rows[poison]["attempts"] == 1

    # Now the poison row is retried (10 ms, 20 ms) until it parks, then the later row flows.
    logs = []
    for _ in range(10):
        wait_due(db, poison)
        r = relay_once(db, servers, *FAST)
        assert r.returncode == 0, r.stderr
        logs.append(r.stderr)
        rows = outbox(db)
        if rows[poison]["status"] == "failed" and rows[later]["status"] == "sent":
            break
    rows = outbox(db)
    p = rows[poison]
    assert (p["status"], p["attempts"]) == ("failed", 3), p
    assert "unroutable" in p["last_error"]
    assert (rows[later]["status"], rows[later]["attempts"]) == ("sent", 0), rows[later]

    # The order of what happened to the subscription's two rows: the later row became 'sent'
    # only after the poison row was parked, never while the poison row was still retrying.
    hist = [(("poison" if e == poison else "later"), st, a) for e, st, a in audit(db)
            if e in (poison, later)]
    assert hist == [("poison", "pending", 1), ("poison", "pending", 2), ("poison", "failed", 3),
                    ("later", "sent", 0)], (
        "the later row of the poison row's subscription was published while the poison row was "
        f"still retrying; updates in order: {hist}\nrelay logs:\n" + "\n".join(logs))

    got = read_queue(broker, queue, expect=3)
    assert [m.event_id for m in got if m.sub == sub] == [later]
    assert sorted(m.event_id for m in got) == sorted([o1, o2, later])
