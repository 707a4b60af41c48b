"""`idem dlq show` prints one dead letter (code, detail, properties, headers, body) and leaves it
where it is; `idem dlq discard` removes exactly the selected dead letters for good (by id, by
code, all) and prints how many; RabbitMQ stopped in the middle of a discard loses nothing that
was not discarded."""

import json
import subprocess
import time

import pika
import pytest

from conftest import IDEM, new_id, payload, run_idem, wait_until
from test_failing_handler_retried_then_dead_lettered import inject_failure


def dlq(servers, *args):
    return run_idem("dlq", *args, amqp_url=servers.amqp_url, timeout=60)


def listed(servers, queue):
    r = dlq(servers, "list", "--queue", queue, "--json", "--limit", "100000")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def fill_dlq(broker, queue, letters):
    """Declares QUEUE.dlq (durable) unless it exists and puts letters [(event_id, code[, detail]),
    ...] in it, persistent, in one connection."""
    if broker.queue_info(queue + ".dlq") is None:  # else as idem declared it (quorum)
        with broker.channel() as ch:
            ch.queue_declare(queue=queue + ".dlq", durable=True)
    before = broker.depth(queue + ".dlq")
    with broker.channel() as ch:  # no confirm per message (slow): the depth says when all are in
        for eid, code, *detail in letters:
            detail = detail[0] if detail else f"detail of {eid}"
            p = pika.BasicProperties(message_id=eid, type="payment.failed", delivery_mode=2,
                                     timestamp=int(time.time()), content_type="application/json",
                                     headers={"x-idem-error": f"{code}: {detail}"})
            ch.basic_publish(exchange="", routing_key=queue + ".dlq", properties=p,
                             body=json.dumps(payload()).encode())
    wait_until(lambda: broker.depth(queue + ".dlq") == before + len(letters), 60, 0.1,
               f"{len(letters)} dead letters in {queue}.dlq")


def test_show_prints_one_dead_letter_and_leaves_it(db, queue, consumers, broker, servers):
    inject_failure(db, "billing.dunning", "P0001")
    c = consumers("billing", queue, db)
    body = payload()
    eid = broker.publish_event("payment.failed", body, timestamp=int(time.time()) - 30,
                               headers={"traceparent": "00-ab-01", "tenant": "<b>x</b>"})
    other = broker.publish_event("payment.failed", payload())
    c.wait_metric("idem_consumer_dead_lettered_total", 2)
    assert c.stop() == 0
    wait_until(lambda: broker.depth(queue + ".dlq") == 2, 10, 0.1, "2 dead letters")

    r = dlq(servers, "show", "--queue", queue, "--event-id", eid.upper(), "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["event_id"] == eid and m["event_type"] == "payment.failed"
    assert m["code"] == "handler_rejected" and "it_fail" in m["detail"]
    assert 25 <= m["age_seconds"] <= 600
    assert json.loads(m["body"]) == body and m["body_escaped"] is False
    assert m["body_bytes"] == len(m["body"].encode())
    assert m["headers"]["traceparent"] == "00-ab-01" and m["headers"]["tenant"] == "<b>x</b>"
    assert m["headers"]["x-idem-error"].startswith("handler_rejected:")
    assert m["properties"]["message_id"] == eid
    assert m["properties"]["delivery_mode"] == 2
    assert m["properties"]["content_type"] == "application/json"

    text = dlq(servers, "show", "--queue", queue, "--event-id", eid)
    assert text.returncode == 0, text.stderr
    assert "traceparent: 00-ab-01" in text.stdout and body["invoice_id"] in text.stdout
    assert "code: handler_rejected" in text.stdout

    # shown twice, nothing taken, the order kept
    assert [x["event_id"] for x in listed(servers, queue)] == [eid, other]
    r = dlq(servers, "show", "--queue", queue, "--event-id", new_id())
    assert r.returncode == 1 and "is not in" in r.stderr, r.stderr
    assert dlq(servers, "show", "--queue", queue).returncode == 2
    assert dlq(servers, "show", "--queue", queue, "--event-id", "nope").returncode == 2


def test_show_escapes_bytes_that_are_not_text(queue, broker, servers):
    eid = new_id()
    with broker.channel() as ch:
        ch.queue_declare(queue=queue + ".dlq", durable=True)
        ch.basic_publish(exchange="", routing_key=queue + ".dlq", body=b"a\x00b\xff\\c\x1b[2J",
                         properties=pika.BasicProperties(
                             message_id=eid, headers={"x-idem-error": "malformed_json: no",
                                                      "n": 7, "nested": {"k": [1, "two"]}}))
    m = json.loads(dlq(servers, "show", "--queue", queue, "--event-id", eid, "--json").stdout)
    assert m["body"] == "a\\x00b\\xff\\\\c\\x1b[2J" and m["body_escaped"] is True
    assert m["body_bytes"] == 10
    assert m["headers"]["n"] == 7 and m["headers"]["nested"] == {"k": [1, "two"]}
    text = dlq(servers, "show", "--queue", queue, "--event-id", eid)
    assert "\x1b" not in text.stdout and "body (escaped):" in text.stdout


def test_discard_by_id_by_code_and_all(queue, broker, servers):
    a = [new_id() for _ in range(3)]
    b = [new_id() for _ in range(2)]
    fill_dlq(broker, queue, [(a[0], "handler_rejected"), (b[0], "malformed_json"),
                             (a[1], "handler_rejected"), (b[1], "malformed_json"),
                             (a[2], "handler_rejected")])
    r = dlq(servers, "discard", "--queue", queue, "--event-id", a[1].upper())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "discarded 1"
    assert [x["event_id"] for x in listed(servers, queue)] == [a[0], b[0], b[1], a[2]]

    r = dlq(servers, "discard", "--queue", queue, "--all", "--code", "malformed_json")
    assert r.returncode == 0 and r.stdout.strip() == "discarded 2", (r.stdout, r.stderr)
    assert [x["event_id"] for x in listed(servers, queue)] == [a[0], a[2]]

    # an id with another code is not discarded; nothing there: 0
    r = dlq(servers, "discard", "--queue", queue, "--event-id", a[0], "--code", "malformed_json")
    assert r.returncode == 0 and r.stdout.strip() == "discarded 0"
    r = dlq(servers, "discard", "--queue", queue, "--all")
    assert r.returncode == 0 and r.stdout.strip() == "discarded 2"
    assert broker.depth(queue + ".dlq") == 0
    assert dlq(servers, "discard", "--queue", queue).returncode == 2
    assert dlq(servers, "discard", "--queue", queue, "--all", "--event-id", a[0]).returncode == 2
    r = dlq(servers, "discard", "--queue", "it.no.such." + new_id(), "--all")
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr


@pytest.mark.slow  # a RabbitMQ restart
def test_rabbitmq_stopped_mid_discard_loses_nothing_else(queue, broker, servers):
    n = 3000
    letters = [(new_id(), "handler_rejected" if i % 2 == 0 else "malformed_json")
               for i in range(n)]
    fill_dlq(broker, queue, letters)
    keep = {e for e, c in letters if c == "malformed_json"}
    drop = {e for e, c in letters if c == "handler_rejected"}
    p = subprocess.Popen([IDEM, "--amqp", servers.amqp_url, "dlq", "discard", "--queue", queue,
                          "--all", "--code", "handler_rejected"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    restarted = False
    try:
        # stop the broker once the discard is well under way but not done
        wait_until(lambda: (broker.depth(queue + ".dlq") or n) < n - 300 or p.poll() is not None,
                   30, 0.02, "the discard under way")
        servers.rmq_stop()
        out, err = p.communicate(timeout=60)
        servers.rmq_start()
        restarted = True
    finally:
        if not restarted:
            servers.rmq_start()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, (out, err)  # cut off mid-way: it says so
    discarded = int(out.strip().split()[-1])
    assert 0 < discarded < len(drop), out
    left = wait_until(lambda: listed(servers, queue), 60, 0.5, "the DLQ back")
    ids = [x["event_id"] for x in left]
    assert len(ids) == len(set(ids))
    assert keep <= set(ids)  # nothing that was not selected is gone
    # at most what it counted is gone (an ack in flight when the broker stopped may leave one)
    assert len(drop & set(ids)) >= len(drop) - discarded
    assert len(drop & set(ids)) <= len(drop) - discarded + 1
    # what stays is in its order
    order = [e for e, _ in letters]
    assert ids == sorted(ids, key=order.index)
    r = dlq(servers, "discard", "--queue", queue, "--all", "--code", "handler_rejected")
    assert r.returncode == 0, r.stderr
    assert {x["event_id"] for x in listed(servers, queue)} == keep


def test_global_flags_before_the_command(queue, broker, servers):
    eid = new_id()
    fill_dlq(broker, queue, [(eid, "handler_rejected")])
    for sub in (["list", "--queue", queue, "--json"],
                ["show", "--queue", queue, "--event-id", eid, "--json"]):
        r = subprocess.run([IDEM, "--amqp", servers.amqp_url, "--log-level", "warn", "dlq", *sub],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert eid in r.stdout
