"""`idem status` per consumer and per pending row: each consumer of the ledger with its last
applied time and, for each `--queue CONSUMER=QUEUE`, the queue's and its DLQ's depths (passive
declares); RabbitMQ unreachable is said in the output and exits 4. For the oldest pending rows it
says why each one waits: in flight on a relay (its open transaction locks the row), behind such a
row, waiting for a retry, held behind a retrying row of its subscription, or due with no relay
taking it. The contract's keys of `status --json` stay as they are."""

import json
import time

from conftest import new_id, payload, run_idem, wait_until
from ops_helpers import closed_port
from relay_helpers import declare_consumer_queue, emit_many, relay_daemons
from test_relay_hung_holds_only_its_subscription import EMIT_SERIES, freeze_holding, sent_of

__all__ = ["relay_daemons"]

CONTRACT_KEYS = {"event_types", "totals", "ledger"}
TYPE = "payment.failed"
ROWS = 2000  # of the subscription the frozen relay holds: several batches of 200


def status(db, servers, *args, amqp_url=None, code=0):
    """`idem status ARGS` against the test's database (and amqp_url or the session's broker)."""
    r = run_idem("status", *args, pg_url=db.url, amqp_url=amqp_url or servers.amqp_url)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    return r


def status_json(db, servers, *args, **kw):
    doc = json.loads(status(db, servers, "--json", *args, **kw).stdout)
    assert CONTRACT_KEYS <= set(doc)
    return doc


def consumer(doc, name):
    [c] = [c for c in doc["consumers"] if c["consumer"] == name]
    return c


def test_consumer_with_a_backlog_and_dead_letters_shows_its_depths(db, servers, broker, queue,
                                                                   consumers):
    c = consumers("billing", queue, db)
    applied = [broker.publish_event(TYPE, payload()) for _ in range(2)]
    for _ in range(3):
        broker.publish_raw("{not json", routing_key=TYPE, message_id=new_id(), type=TYPE)
    c.wait_metric("idem_consumer_applied_total", 2)
    c.wait_metric("idem_consumer_dead_lettered_total", 3)
    assert c.stop() == 0
    for _ in range(4):  # the backlog: nobody consumes now
        broker.publish_event(TYPE, payload())
    wait_until(lambda: broker.depth(queue) == 4, 10, 0.1, "4 messages ready")

    doc = status_json(db, servers, "--queue", f"billing={queue}", "--queue", "nosuch.q")
    b = consumer(doc, "billing")
    assert b["ledger_rows"] == 2
    assert 0 <= b["last_applied_seconds"] < 60 and b["last_applied_at"].endswith("Z")
    assert b["queues"] == [{"queue": queue, "ready": 4, "consumers": 0, "dlq": queue + ".dlq",
                            "dlq_ready": 3, "error": None}]
    [other] = [x for x in doc["consumers"] if x["consumer"] is None]
    assert other["queues"][0]["queue"] == "nosuch.q"
    assert other["queues"][0]["error"] == "no such queue"
    assert doc["rabbitmq_error"] is None
    assert sorted(e for _, e in db.ledger("billing")) == sorted(applied)

    text = status(db, servers, "--queue", f"billing={queue}").stdout
    [line] = [ln for ln in text.splitlines() if queue in ln]
    cols = line.split()
    assert cols[0] == "billing" and cols[-4:] == [queue, "4", "0", "3"], line
    assert "ago" in line


def test_rabbitmq_unreachable_is_said_and_exits_4(db, servers):
    dead = f"amqp://guest:guest@127.0.0.1:{closed_port()}"
    r = status(db, servers, "--queue", "billing=billing.q", amqp_url=dead, code=4)
    assert "cannot connect to RabbitMQ at 127.0.0.1:" in r.stdout
    assert r.stderr.startswith("idem status: cannot connect to RabbitMQ")
    doc = json.loads(status(db, servers, "--json", "--queue", "billing=billing.q",
                            amqp_url=dead, code=4).stdout)
    assert doc["rabbitmq_error"].startswith("cannot connect to RabbitMQ")
    assert consumer(doc, "billing")["queues"][0]["ready"] is None
    # without --queue RabbitMQ is not asked
    status(db, servers, amqp_url=dead, code=0)
    # the threshold's alert wins over the broker it could not read
    emit_many(db, [(TYPE, new_id(), new_id(), payload())])
    time.sleep(1.1)
    status(db, servers, "--queue", "q", "--max-age", "1s", amqp_url=dead, code=1)


def row(doc, event_id):
    [r] = [r for r in doc["pending_rows"]["oldest"] if r["event_id"] == event_id]
    return r


def test_row_held_behind_a_retrying_row_says_so(db, servers, broker, queue, relay_daemons):
    """The subscription's first row is bound to no queue (returned: one attempt spent, a
    minute's backoff); its next row is held behind it; once no relay runs a new row is due."""
    declare_consumer_queue(broker, queue, [TYPE])
    sub = new_id()
    head, behind = emit_many(db, [("unbound.type", sub, new_id(), payload(subscription_id=sub)),
                                  (TYPE, sub, new_id(), payload(subscription_id=sub))])
    relay = relay_daemons(("--poll-interval", "50ms", "--backoff-base", "60s",
                           "--backoff-max", "60s"))
    wait_until(lambda: db.count("idem.event_outbox", "event_id = %s AND attempts = 1", head) == 1,
               20, 0.05, "the head returned once", [relay])
    assert relay.stop() == 0
    [due] = emit_many(db, [(TYPE, new_id(), new_id(), payload())])

    doc = status_json(db, servers)
    by = doc["pending_rows"]["by_reason"]
    assert (by["retrying"], by["held"], by["due"], by["in_flight"]) == (1, 1, 1, 0), by
    h = row(doc, head)
    assert h["reason"] == "retrying" and h["attempts"] == 1
    assert 1 < h["next_attempt_in_seconds"] <= 60
    b = row(doc, behind)
    assert b["reason"] == "held" and b["behind_event_id"] == head and b["behind_attempts"] == 1
    assert 1 < b["next_attempt_in_seconds"] <= 60
    assert row(doc, due)["reason"] == "due"

    text = status(db, servers).stdout
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.split()}
    assert "waiting for retry (attempt 1, next in " in lines[head]
    assert f"held behind a retrying row {head} (attempt 1, next in " in lines[behind]
    assert "no relay has taken it" in lines[due]


def test_row_locked_by_a_frozen_relay_says_in_flight_on_its_pid(db, servers, broker, queue,
                                                                relay_daemons):
    declare_consumer_queue(broker, queue, [TYPE])
    sub = new_id()
    assert db.scalar(EMIT_SERIES, TYPE, sub, 1, ROWS) == ROWS
    relay = relay_daemons(("--poll-interval", "50ms"), name="relay-frozen")
    wait_until(lambda: sent_of(db, sub) > 0, 20, 0.01, "the relay publishing", [relay])
    freeze_holding(relay, db, sub)
    try:
        doc = status_json(db, servers, "--rows", "300")
        [holder] = doc["pending_rows"]["holders"]
        assert holder["relay_pid"] == relay.pid and holder["rows"] >= 1
        assert holder["application_name"] == f"idem relay pid {relay.pid}"
        first = doc["pending_rows"]["oldest"][0]
        assert first["reason"] == "in_flight" and first["relay_pid"] == relay.pid
        assert first["pid"] == holder["pid"]
        by = doc["pending_rows"]["by_reason"]
        assert by["in_flight"] == holder["rows"]
        assert by["behind_in_flight"] == ROWS - sent_of(db, sub) - holder["rows"] > 0
        behind = [r for r in doc["pending_rows"]["oldest"] if r["reason"] != "in_flight"]
        assert behind and all(r["reason"] == "behind_in_flight" and r["relay_pid"] == relay.pid
                              for r in behind)
        text = status(db, servers).stdout
        assert f"in flight on relay pid {relay.pid} (server pid {holder['pid']})" in text
        assert f"server pid {holder['pid']} holds {holder['rows']} rows" in text
    finally:
        relay.resume()
    # resumed, it carries on (a loaded machine may have it reconnect first)
    wait_until(lambda: sent_of(db, sub) == ROWS, 180, 0.1, "every row sent", [relay])
    assert relay.stop() == 0
    assert status_json(db, servers)["pending_rows"]["by_reason"] == {
        "in_flight": 0, "behind_in_flight": 0, "retrying": 0, "held": 0, "due": 0}
