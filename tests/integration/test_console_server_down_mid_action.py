"""A server going down in the middle of a console action loses nothing and applies nothing
twice: PostgreSQL stopped while a replay waits for its row leaves the row failed (the console
answers 503), and the replay after the restart is published and applied once; RabbitMQ stopped
while a requeue walks the dead-letter queue leaves every dead letter where it was, and the
requeue after the restart is applied once."""

import threading

import pytest

from conftest import new_id, payload, wait_until
from console_helpers import consoles  # noqa: F401
from ops_helpers import emit, relays  # noqa: F401
from test_dlq_show_and_discard import fill_dlq
from test_replay import park


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def test_postgres_stopped_during_a_replay(db, servers, queue, consumers, relays, consoles):
    sub = new_id()
    eid = emit(db, "payment.failed", payload(subscription_id=sub))
    park(db, eid)
    c = consumers("billing", queue, db)
    relays()
    con = consoles(db)
    restarted = False
    try:
        with db.connect(autocommit=False) as blocker:
            with blocker.cursor() as cur:
                cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
            t, out = in_thread(lambda: con.post("/api/replay", {"event_id": eid}))
            wait_until(lambda: db.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                "wait_event_type = 'Lock' AND query LIKE '%idem.idem_replay(%'")
                >= 1, 15, 0.05,
                "the replay waiting for its row")
            servers.pg_stop_immediate()
        t.join(60)
        status, body = out["r"]
        assert status == 503, body
        servers.pg_start()
        restarted = True
    finally:
        if not restarted:
            servers.pg_start()
    # nothing of the cut replay stayed: the row is still failed, nothing was published
    row = wait_until(lambda: _row(db, eid), 30, 0.5, "PostgreSQL back")
    assert row == ("failed", 8)
    assert db.ledger("billing") == []
    assert con.running() and c.running()
    status, body = con.post("/api/replay", {"event_id": eid})
    assert (status, body) == (200, {"replayed": 1})
    wait_until(lambda: db.dunning_step(sub) == 1, 60, 0.2, "the replayed event applied")
    assert con.post("/api/replay", {"event_id": eid})[0] == 404  # no longer a failed row
    assert c.stop() == 0
    assert db.ledger("billing") == [("billing", eid)]
    assert db.dunning_step(sub) == 1


def _row(db, eid):
    try:
        return db.query("SELECT status, attempts FROM idem.event_outbox WHERE event_id = %s", eid)[0]
    except Exception:
        return None


@pytest.mark.slow  # a RabbitMQ restart and 3000 dead letters: about 2-3 minutes here
def test_rabbitmq_stopped_during_a_requeue(db, servers, broker, queue, consumers, consoles):
    c = consumers("billing", queue, db)  # declares the queue and its bindings
    assert c.stop() == 0
    n = 3000
    letters = [(new_id(), "handler_rejected") for _ in range(n)]
    fill_dlq(broker, queue, letters)
    target = letters[-1][0]  # the requeue walks past every other one first
    con = consoles(db, queues=[queue])
    restarted = False
    try:
        t, out = in_thread(lambda: con.post("/api/dlq/requeue",
                                            {"queue": queue, "event_id": target}))
        wait_until(lambda: (broker.depth(queue + ".dlq") or n) < n - 300 or not t.is_alive(),
                   30, 0.02, "the requeue under way")
        servers.rmq_stop()
        t.join(60)
        servers.rmq_start()
        restarted = True
    finally:
        if not restarted:
            servers.rmq_start()
    status, body = out["r"]
    assert status == 503 and body["requeued"] == 0, body
    # every dead letter is back in its queue, none moved, none twice
    wait_until(lambda: broker.depth(queue + ".dlq") == n, 60, 0.5, "the DLQ whole again")
    assert broker.depth(queue) == 0
    assert con.running()
    status, body = wait_until(
        lambda: (lambda r: r if r[0] == 200 else None)(
            con.post("/api/dlq/requeue", {"queue": queue, "event_id": target})),
        30, 0.5, "the requeue after the restart")
    assert body == {"requeued": 1}
    c = consumers("billing", queue, db)
    c.wait_metric("idem_consumer_applied_total", 1, timeout=60)
    assert c.stop() == 0
    assert db.ledger("billing") == [("billing", target)]
    assert broker.depth(queue + ".dlq") == n - 1
