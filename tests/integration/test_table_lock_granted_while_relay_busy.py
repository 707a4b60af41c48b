"""A lock on the outbox table (a migration's ALTER TABLE, an operator's LOCK TABLE) is granted
while relays are busy, as soon as their batches in flight commit: it never waits for the relays'
lock timeout.

Once the lock is requested, a relay's next claim queues behind it (PostgreSQL grants locks in
order), while the relay's batches in flight hold the table and must finish for the lock to be
granted. A relay that held those batches back until the queued claim got through would stall
everyone (the lock, the claim, the batches, and behind the lock every other client of the table)
until the claim's lock timeout broke the circle. Here the relays run with --lock-timeout 30s
over a backlog; a LOCK TABLE ... ACCESS EXCLUSIVE with a 10 s lock_timeout must be granted, and
everything is then sent once.
"""

import threading
import time

import pytest

from conftest import free_port, wait_until
from relay_helpers import relay_daemons, status_counts

__all__ = ["relay_daemons"]

TYPE = "payment.failed"


def backlog(db, queues, broker, n=30_000):
    """A queue bound to TYPE, and n pending rows over 300 subscriptions (so that the batches in
    flight and the claims overlap all the time); returns (queue, n)."""
    q = queues.new()
    with broker.channel() as ch:
        broker.declare_exchange(ch)
        ch.queue_declare(queue=q, durable=False)
        ch.queue_bind(queue=q, exchange="billing.events", routing_key=TYPE)
    db.execute("INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload)"
               " SELECT gen_random_uuid(), ('00000000-0000-4000-8000-' || lpad((i %% 300)::text,"
               " 12, '0'))::uuid, %s, jsonb_build_object('n', i)"
               " FROM generate_series(1, %s) AS i", TYPE, n)
    return q, n


@pytest.mark.slow
def test_table_lock_granted_while_relays_busy(db, servers, queues, broker, relay_daemons):
    q, n = backlog(db, queues, broker)
    relays = [relay_daemons(["--lock-timeout", "30s", "--batch", "50"], name=f"relay{i}")
              for i in (1, 2)]
    wait_until(lambda: sum(r.sent() for r in relays) > 2000, 30, 0.01, "the relays publishing")

    waits = []
    for _ in range(3):
        with db.connect(autocommit=False) as conn, conn.cursor() as cur:
            cur.execute("SET lock_timeout = '10s'")
            t = time.monotonic()
            cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
            waits.append(time.monotonic() - t)
            time.sleep(0.3)
            conn.commit()
        time.sleep(0.5)
    assert max(waits) < 5, f"the table lock waited {max(waits):.1f} s for the relays: {waits}"

    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == n, 60, 0.2,
               lambda: f"{n} rows sent (now {status_counts(db)})")
    wait_until(lambda: broker.depth(q) >= n, 10, 0.2, "every message in the queue")
    time.sleep(0.5)
    assert broker.queue_info(q)[0] == n, "a row was published twice"
    for r in relays:
        assert r.stop() == 0
    print(f"the table lock waited {', '.join(f'{w * 1000:.0f} ms' for w in waits)}")


@pytest.mark.slow
def test_table_lock_granted_while_the_backlog_gauge_waits(db, servers, queues, broker,
                                                          relay_daemons):
    """The relay reads its backlog gauge (with --metrics-port) on its control connection once a
    second. While a lock request on the outbox is queued, that read queues behind it; were the
    relay to wait for it, its batches in flight could not commit, the lock could not be granted,
    and relay and lock would wait on each other until one timed out. Here RabbitMQ holds the
    relay's confirms back (a memory alarm) while LOCK TABLE queues behind its batches in flight
    for 2.5 s (gauge reads queue behind the request); once the alarm clears, the lock must be
    granted within seconds, not at its own timeout."""
    q, n = backlog(db, queues, broker)
    relay = relay_daemons(["--lock-timeout", "30s", "--batch", "50", "--metrics-port",
                           str(free_port())])
    wait_until(lambda: relay.sent() > 2000, 30, 0.01, "the relay publishing")

    result = {}

    def lock():
        with db.connect(autocommit=False) as conn, conn.cursor() as cur:
            cur.execute("SET lock_timeout = '20s'")
            try:
                cur.execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
                result["granted"] = time.monotonic()
            except Exception as e:  # reported below
                result["error"] = str(e)
            conn.rollback()

    servers.rmqctl("set_vm_memory_high_watermark", "0.000001")
    try:
        time.sleep(0.5)  # the relay's batches in flight wait for their confirms
        t = threading.Thread(target=lock)
        t.start()
        time.sleep(2.5)  # the lock request queues; the relay's gauge reads queue behind it
    finally:
        servers.rmqctl("set_vm_memory_high_watermark", "0.4")
    released = time.monotonic()
    t.join(30)
    assert "error" not in result, result.get("error")
    waited = result["granted"] - released
    assert waited < 5, f"the table lock was granted {waited:.1f} s after the alarm cleared"
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == n, 60, 0.2,
               lambda: f"{n} rows sent (now {status_counts(db)})")
    assert relay.stop() == 0
    print(f"the table lock was granted {waited * 1000:.0f} ms after the alarm cleared")
