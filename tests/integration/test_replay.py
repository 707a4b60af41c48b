"""`idem failed` lists parked rows; `idem replay` returns them to pending (attempts 0, next
attempt now, last_error kept), all or nothing, refusing rows older than the dedup window and ids
that are not failed rows; a replayed row is published by the relay and applied once."""

import json
import re

from conftest import new_id, payload
from ops_helpers import add_outbox, emit, idem, outbox_ids, stderr_line

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def row(db, event_id):
    return db.query("SELECT status, attempts, last_error, next_attempt_at <= now(), sent_at "
                    "FROM idem.event_outbox WHERE event_id = %s", event_id)[0]


def park(db, event_id, error="basic.return: 312 NO_ROUTE", age=None):
    """Marks a row failed as the relay does after its last attempt."""
    db.execute("UPDATE idem.event_outbox SET status = 'failed', attempts = 8, last_error = %s, "
               "next_attempt_at = now() + interval '1 hour' WHERE event_id = %s", error, event_id)
    if age:
        db.execute("UPDATE idem.event_outbox SET created_at = now() - %s::interval "
                   "WHERE event_id = %s", age, event_id)


def test_failed_lists_failed_rows(db, servers):
    body = payload()
    eid = emit(db, "payment.failed", body)
    park(db, eid, error="nacked by broker\nsecond line")
    add_outbox(db, 2, "pending")
    add_outbox(db, 2, "sent")

    r = idem(db, servers, "failed")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout  # one line per failed row, newline in last_error folded
    assert lines[0].startswith(eid + " payment.failed ")
    assert "attempts=8" in lines[0]
    assert "nacked by broker second line" in lines[0]
    assert body["subscription_id"] in lines[0]

    r = idem(db, servers, "failed", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 1
    got = rows[0]
    assert set(got) == {"event_id", "outbox_id", "event_type", "subscription_id", "attempts",
                        "created_at", "last_error"}
    assert got["event_id"] == eid
    assert got["event_type"] == "payment.failed"
    assert got["subscription_id"] == body["subscription_id"]
    assert got["attempts"] == 8
    assert got["last_error"] == "nacked by broker\nsecond line"
    assert re.fullmatch(UUID, got["outbox_id"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", got["created_at"])


def test_failed_empty(db, servers):
    r = idem(db, servers, "failed")
    assert r.returncode == 0 and r.stdout == ""
    r = idem(db, servers, "failed", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == []


def test_replay_one_row(db, servers):
    eid = emit(db, "payment.failed", payload())
    other = emit(db, "payment.failed", payload())
    park(db, eid)
    park(db, other)
    r = idem(db, servers, "replay", "--event-id", eid)
    assert r.returncode == 0, r.stderr
    assert re.search(r"\b1\b", r.stdout) and "pending" in r.stdout, r.stdout
    status, attempts, last_error, due, sent_at = row(db, eid)
    assert (status, attempts, due, sent_at) == ("pending", 0, True, None)
    assert last_error == "basic.return: 312 NO_ROUTE"  # kept for the record
    assert row(db, other)[0] == "failed"  # only the named row


def test_replay_accepts_any_uuid_form(db, servers):
    eid = emit(db, "payment.failed", payload())
    park(db, eid)
    weird = "{" + eid.replace("-", "").upper() + "}"
    r = idem(db, servers, "replay", "--event-id", weird)
    assert r.returncode == 0, r.stderr
    assert row(db, eid)[0] == "pending"


def test_replay_refuses_ids_that_are_not_failed_rows(db, servers):
    pending = emit(db, "payment.failed", payload())
    sent = add_outbox(db, 1, "sent")[0]
    for eid in (pending, sent, new_id()):
        r = idem(db, servers, "replay", "--event-id", eid)
        assert r.returncode == 1, (eid, r.stdout, r.stderr)
        assert stderr_line(r).startswith("idem replay: ")
        assert eid in r.stderr
        assert r.stdout == ""
    assert row(db, pending)[0] == "pending"
    assert row(db, sent)[0] == "sent"


def test_replay_refuses_a_row_older_than_the_dedup_window(db, servers):
    eid = emit(db, "payment.failed", payload())
    park(db, eid, age="31 days")
    r = idem(db, servers, "replay", "--event-id", eid)
    assert r.returncode == 1
    line = stderr_line(r)
    assert "dedup window" in line and eid in line, line
    assert row(db, eid)[0] == "failed"
    # the window is the operator's: a longer one accepts the row
    r = idem(db, servers, "replay", "--event-id", eid, "--dedup-window", "40d")
    assert r.returncode == 0, r.stderr
    assert row(db, eid)[:2] == ("pending", 0)


def test_replay_all_failed_is_all_or_nothing(db, servers):
    young = [emit(db, "payment.failed", payload()) for _ in range(3)]
    for e in young:
        park(db, e, age="1 day")
    old = emit(db, "invoice.paid", payload())
    park(db, old, age="3 days")

    r = idem(db, servers, "replay", "--all-failed", "--dedup-window", "2d")
    assert r.returncode == 1
    line = stderr_line(r)
    assert "dedup window" in line, line
    assert r.stdout == ""
    assert outbox_ids(db, "status = 'failed'") == sorted(young + [old])  # nothing changed
    assert db.count("idem.event_outbox", "attempts = 8") == 4

    r = idem(db, servers, "replay", "--all-failed")  # default window 30d
    assert r.returncode == 0, r.stderr
    assert re.search(r"\b4\b", r.stdout), r.stdout
    assert db.count("idem.event_outbox", "status = 'failed'") == 0
    assert db.count("idem.event_outbox", "status = 'pending' AND attempts = 0 "
                                    "AND next_attempt_at <= now()") == 4
    assert db.count("idem.event_outbox", "last_error IS NULL") == 0

    r = idem(db, servers, "replay", "--all-failed")  # nothing left: fine, says 0
    assert r.returncode == 0, r.stderr
    assert re.search(r"\b0\b", r.stdout), r.stdout


def test_replay_usage_errors(db, servers):
    eid = emit(db, "payment.failed", payload())
    park(db, eid)
    for args in ([], ["--all-failed", "--event-id", eid], ["--event-id", "not-a-uuid"],
                 ["--event-id", eid + "0"], ["--event-id", eid, "--dedup-window", "30"],
                 ["--all-failed", "--dedup-window", "1w"]):
        r = idem(db, servers, "replay", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert stderr_line(r).startswith("idem replay: ")
    assert row(db, eid)[0] == "failed"


def test_replayed_row_is_published_and_applied_once(db, servers, queue, consumers, broker):
    """failed -> replay -> `idem relay --once` publishes it -> `idem consume` applies it once."""
    body = payload()
    eid = emit(db, "payment.failed", body)
    park(db, eid)
    c = consumers("billing", queue, db)  # binds the queue before anything is published

    r = idem(db, servers, "relay", "--once")
    assert r.returncode == 0, r.stderr
    assert db.count("idem.event_outbox", "status = 'failed'") == 1  # parked rows are not published

    r = idem(db, servers, "replay", "--event-id", eid)
    assert r.returncode == 0, r.stderr
    r = idem(db, servers, "relay", "--once")
    assert r.returncode == 0, r.stderr
    assert row(db, eid)[0] == "sent"

    c.wait_handled(1)
    assert c.metric("idem_consumer_applied_total") == 1
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]

    # the same event delivered again (e.g. replayed by hand) is a duplicate, not a second effect
    broker.publish_event("payment.failed", body, event_id=eid)
    c.wait_handled(2)
    assert c.metric("idem_consumer_duplicates_total") == 1
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]

    # it is no longer a failed row
    r = idem(db, servers, "replay", "--event-id", eid)
    assert r.returncode == 1
