"""`idem dlq list` shows a consumer's dead letters (event id, type, code, detail, age) without
taking them off QUEUE.dlq; `idem dlq requeue` moves exactly the selected messages back to QUEUE,
each publish confirmed before its DLQ copy is acked, without x-idem-error and with
x-idem-requeued counting the moves; requeued events are applied once."""

import json
import time

from conftest import new_id, payload, run_idem, wait_until
from test_failing_handler_retried_then_dead_lettered import inject_failure, remove_failure


def dlq(servers, *args):
    return run_idem("dlq", *args, amqp_url=servers.amqp_url, timeout=60)


def listed(servers, queue):
    r = dlq(servers, "list", "--queue", queue, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_list_then_requeue_selected(db, queue, consumers, broker, servers):
    inject_failure(db, "billing.dunning", "P0001")
    c = consumers("billing", queue, db)
    subs = [new_id() for _ in range(3)]
    ids = [broker.publish_event("payment.failed", payload(subscription_id=s),
                                timestamp=int(time.time()) - 60) for s in subs]
    bad = new_id()
    broker.publish_raw("{not json", routing_key="payment.failed", message_id=bad,
                       type="payment.failed")
    c.wait_metric("idem_consumer_dead_lettered_total", 4)
    wait_until(lambda: broker.depth(queue + ".dlq") == 4, 10, 0.1, "4 dead letters")

    # list: every message, its code and detail, nothing taken
    rows = listed(servers, queue)
    assert len(rows) == 4
    by_id = {r["event_id"]: r for r in rows}
    assert set(by_id) == set(ids) | {bad}
    for i in ids:
        assert by_id[i]["code"] == "handler_rejected", by_id[i]
        assert "it_fail" in by_id[i]["detail"]
        assert by_id[i]["event_type"] == "payment.failed"
        assert 55 <= by_id[i]["age_seconds"] <= 600
        assert by_id[i]["requeued"] == 0
    assert by_id[bad]["code"] == "malformed_json"
    assert broker.depth(queue + ".dlq") == 4
    assert len(listed(servers, queue)) == 4  # listing twice changes nothing
    r = dlq(servers, "list", "--queue", queue, "--limit", "2", "--json")
    assert len(json.loads(r.stdout)) == 2
    text = dlq(servers, "list", "--queue", queue)
    assert text.returncode == 0 and ids[0] in text.stdout and "handler_rejected" in text.stdout

    # the cause is fixed: requeue one event by id
    remove_failure(db, "billing.dunning")
    r = dlq(servers, "requeue", "--queue", queue, "--event-id", ids[1].upper())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"requeued 1 message from {queue}.dlq to {queue}"
    c.wait_metric("idem_consumer_applied_total", 1)
    assert db.dunning_step(subs[1]) == 1
    assert broker.depth(queue + ".dlq") == 3

    # the rest of one code only; the malformed one stays
    r = dlq(servers, "requeue", "--queue", queue, "--all", "--code", "handler_rejected")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"requeued 2 messages from {queue}.dlq to {queue}"
    c.wait_metric("idem_consumer_applied_total", 3)
    left = listed(servers, queue)
    assert [x["event_id"] for x in left] == [bad]

    # a requeue of something no longer in the DLQ moves nothing; the events applied once
    r = dlq(servers, "requeue", "--queue", queue, "--event-id", ids[1])
    assert r.returncode == 0 and r.stdout.startswith("requeued 0 messages")
    assert c.stop() == 0
    assert db.ledger("billing") == sorted(("billing", i) for i in ids)
    assert [db.dunning_step(s) for s in subs] == [1, 1, 1]


def test_requeued_copy_carries_the_count_and_no_error(db, queue, consumers, broker, servers,
                                                      dead_letters):
    inject_failure(db, "billing.dunning", "P0001")
    c = consumers("billing", queue, db)
    eid = broker.publish_event("payment.failed", payload(), headers={"traceparent": "00-ab-01"})
    c.wait_metric("idem_consumer_dead_lettered_total", 1)
    assert c.stop() == 0  # nobody consumes the requeued copy: read it off the queue
    wait_until(lambda: broker.depth(queue + ".dlq") == 1, 10, 0.1, "the dead letter")
    r = dlq(servers, "requeue", "--queue", queue, "--all")
    assert r.returncode == 0, r.stderr
    got = wait_until(lambda: broker.get_all(queue), 10, 0.1, "the requeued copy")
    assert len(got) == 1
    m = got[0]
    assert m.props.message_id == eid
    assert m.error is None
    assert m.headers.get("x-idem-requeued") == 1
    assert m.header("traceparent") == "00-ab-01"
    assert m.props.delivery_mode == 2
    assert broker.depth(queue + ".dlq") == 0


def test_usage_and_missing_queue(servers):
    assert dlq(servers, "list").returncode == 2
    assert dlq(servers, "requeue", "--queue", "q").returncode == 2  # neither --event-id nor --all
    assert dlq(servers, "requeue", "--queue", "q", "--all", "--event-id", new_id()).returncode == 2
    assert dlq(servers, "requeue", "--queue", "q", "--event-id", "nope").returncode == 2
    assert dlq(servers, "bogus").returncode == 2
    r = dlq(servers, "list", "--queue", "it.no.such." + new_id())
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr, r.stderr
