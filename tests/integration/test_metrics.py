"""`--metrics-port`: Prometheus text at /metrics with the contract's names, counters from 0, every
dead-letter code, both reconnect labels, the batch histogram; values follow what happened."""

import socket

from conftest import EXCHANGE, new_id, payload, run_idem
from ops_helpers import add_outbox, emit, idem, parse_prometheus, scrape, value, wait_until
from ops_helpers import relays  # noqa: F401  (fixture)

DL_CODES = ["malformed_json", "missing_event_id", "invalid_event_id", "unknown_type", "oversized",
            "invalid_payload", "handler_rejected", "retries_exhausted", "stale", "untrusted",
            "conflict"]
CONSUMER_COUNTERS = ["idem_consumer_applied_total", "idem_consumer_duplicates_total",
                     "idem_consumer_handler_errors_total"]
RELAY_COUNTERS = ["idem_relay_published_total", "idem_relay_publish_failures_total",
                  "idem_relay_parked_total"]


def check_common(m):
    """What both roles expose: HELP/TYPE for every family, reconnects by server, a histogram."""
    for name, t in m["types"].items():
        assert name in m["help"], f"no HELP for {name}"
    assert m["types"]["idem_reconnects_total"] == "counter"
    for server in ("postgres", "rabbitmq"):
        assert value(m, "idem_reconnects_total", server=server) is not None
    assert m["types"]["idem_batch_duration_seconds"] == "histogram"
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in m["samples"].items()
                     if name == "idem_batch_duration_seconds_bucket")
    les = [le for le, _ in buckets]
    assert les[0] <= 0.001 and 10.0 in les and les[-1] == float("inf"), les
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    assert counts[-1] == value(m, "idem_batch_duration_seconds_count")
    assert value(m, "idem_batch_duration_seconds_sum") is not None


def consumer_metrics(c):
    status, ctype, text = scrape(c.metrics_port)
    assert status == 200
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype, ctype
    return parse_prometheus(text)


def test_consumer_metrics_start_at_zero(db, queue, consumers):
    c = consumers("billing", queue, db)
    m = consumer_metrics(c)
    check_common(m)
    for name in CONSUMER_COUNTERS:
        assert m["types"][name] == "counter"
        assert value(m, name) == 0, name
    assert m["types"]["idem_consumer_dead_lettered_total"] == "counter"
    got_codes = sorted(dict(labels)["code"] for (name, labels) in m["samples"]
                       if name == "idem_consumer_dead_lettered_total")
    assert got_codes == sorted(DL_CODES)
    for code in DL_CODES:
        assert value(m, "idem_consumer_dead_lettered_total", code=code) == 0
    assert value(m, "idem_reconnects_total", server="postgres") == 0
    assert value(m, "idem_reconnects_total", server="rabbitmq") == 0
    assert value(m, "idem_batch_duration_seconds_count") == 0
    # the consumer does not expose the relay's families
    assert not any(n.startswith("idem_relay_") or n == "idem_outbox_oldest_pending_seconds"
                   for n in m["types"])
    assert scrape(c.metrics_port, "/")[0] == 404
    assert scrape(c.metrics_port, "/metrics/x")[0] == 404


def test_consumer_counts_applied_duplicates_dead_letters(db, queue, consumers, broker,
                                                        dead_letters):
    c = consumers("billing", queue, db)
    bodies = [payload() for _ in range(3)]
    ids = [broker.publish_event("payment.failed", b) for b in bodies]
    c.wait_handled(3)
    # a duplicate is the same event again (another content under its id would be a conflict)
    broker.publish_event("payment.failed", bodies[0], event_id=ids[0])
    broker.publish_raw(b'{"invoice_id": ', routing_key="payment.failed", message_id=new_id(),
                       type="payment.failed")  # malformed JSON
    c.wait_handled(4)
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="malformed_json")
    dead_letters(queue).wait(1)

    m = consumer_metrics(c)
    check_common(m)
    assert value(m, "idem_consumer_applied_total") == 3
    assert value(m, "idem_consumer_duplicates_total") == 1
    assert value(m, "idem_consumer_handler_errors_total") == 0
    for code in DL_CODES:
        want = 1 if code == "malformed_json" else 0
        assert value(m, "idem_consumer_dead_lettered_total", code=code) == want, code
    assert value(m, "idem_batch_duration_seconds_count") >= 1
    assert value(m, "idem_reconnects_total", server="postgres") == 0
    assert value(m, "idem_reconnects_total", server="rabbitmq") == 0

    # by event type: the registered types by name (a malformed delivery under the type it
    # claims), anything else (an unknown type, whose name a sender chooses) as "other", so the
    # label set cannot grow
    broker.publish_event("invoice.paid", payload())
    broker.publish_raw(b'{}', routing_key="payment.failed", message_id=new_id(),
                       type="no.such.type")
    c.wait_handled(5)
    c.wait_metric("idem_consumer_dead_lettered_total", 1, code="unknown_type")
    m = consumer_metrics(c)
    ev = {(dict(labels)["event_type"], dict(labels)["outcome"]): v
          for (name, labels), v in m["samples"].items() if name == "idem_consumer_events_total"}
    assert m["types"]["idem_consumer_events_total"] == "counter"
    assert ev[("payment.failed", "applied")] == 3
    assert ev[("payment.failed", "duplicate")] == 1
    assert ev[("invoice.paid", "applied")] == 1
    assert ev[("payment.failed", "dead_lettered")] == 1  # the malformed one
    assert ev[("other", "dead_lettered")] == 1  # the unknown type
    assert ev[("receipt.requested", "applied")] == 0
    assert {t for t, _ in ev} == {"payment.failed", "invoice.paid", "receipt.requested", "other"}
    assert sum(v for (_, o), v in ev.items() if o == "applied") == value(
        m, "idem_consumer_applied_total")
    assert c.stop() == 0


def bind_queue(broker, queues, key):
    name = queues.new("relay")
    with broker.channel() as ch:
        broker.declare_exchange(ch)
        ch.queue_declare(queue=name, durable=True)
        ch.queue_bind(queue=name, exchange=EXCHANGE, routing_key=key)
    return name


def test_relay_metrics(db, servers, broker, queues, relays):
    q = bind_queue(broker, queues, "invoice.paid")
    for _ in range(3):
        emit(db, "invoice.paid", payload())
    # nobody is bound to this type: every publish comes back (mandatory), the row stays pending
    stuck = add_outbox(db, 1, "pending", "nobody.listens", created_ago="1 hour")[0]

    r = relays(["--max-attempts", "1000", "--backoff-base", "100ms", "--backoff-max", "200ms"])
    m0 = r.metrics()
    check_common(m0)
    for name in RELAY_COUNTERS:
        assert m0["types"][name] == "counter"
    assert m0["types"]["idem_outbox_oldest_pending_seconds"] == "gauge"
    assert not any(n.startswith("idem_consumer_") for n in m0["types"])

    wait_until(lambda: value(r.metrics(), "idem_relay_published_total") == 3, 15, 0.1,
               "3 rows published")
    wait_until(lambda: value(r.metrics(), "idem_relay_publish_failures_total") >= 2, 15, 0.1,
               "returns of the unroutable row counted")
    wait_until(lambda: value(r.metrics(), "idem_outbox_oldest_pending_seconds") >= 3500, 15,
               0.2, "gauge showing the hour-old pending row")
    m = r.metrics()
    check_common(m)
    assert value(m, "idem_relay_published_total") == 3
    assert value(m, "idem_relay_parked_total") == 0
    assert 3500 <= value(m, "idem_outbox_oldest_pending_seconds") < 3700
    assert value(m, "idem_batch_duration_seconds_count") >= 1
    assert broker.depth(q) == 3
    assert r.stop() == 0

    # a relay allowed fewer attempts parks the row; with nothing pending the gauge reads 0
    r2 = relays(["--max-attempts", "1"])
    wait_until(lambda: value(r2.metrics(), "idem_relay_parked_total") == 1, 15, 0.1, "row parked")
    wait_until(lambda: value(r2.metrics(), "idem_outbox_oldest_pending_seconds") == 0, 15, 0.2,
               "gauge back to 0")
    assert db.scalar("SELECT status FROM idem.event_outbox WHERE event_id = %s", stuck) == "failed"
    assert value(r2.metrics(), "idem_relay_published_total") == 0
    assert r2.stop() == 0


def test_metrics_port_in_use_is_reported(db, servers, queue):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = idem(db, servers, "relay", "--metrics-port", str(port), timeout=30)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"cannot serve metrics on port {port}" in r.stderr, r.stderr
        r = run_idem("consume", "--consumer", "m", "--queue", queue, "--metrics-port", str(port),
                     pg_url=db.url, amqp_url=servers.amqp_url, timeout=30)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"cannot serve metrics on port {port}" in r.stderr, r.stderr
