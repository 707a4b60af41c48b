"""One stale rule (contract, "Failure policy (consumer)").

- A failed row that `idem replay --dedup-window 1d` accepts, 86,370 s old, is applied by a
  consumer with `--dedup-window 1d`, not dead-lettered as `stale` (a consumer that subtracted a
  safety margin from its window dead-lettered it, and a DLQ requeue was stale again: that event
  could never be applied). One second past the window, both refuse it.
- `retain` keeps ledger rows long enough for every delivery a consumer accepts as fresh: a
  timestamp up to one day in the future is taken as it is, so an event consumed 25 h ago whose
  timestamp was then 23 h in the future is fresh for a 1-day window today; its ledger row must
  still be there after `retain --dedup-window 1d`, or a redelivery would apply it twice.
"""

import time

from conftest import new_id, payload, wait_until
from ops_helpers import emit, idem
from relay_helpers import relay_once

TYPE = "payment.failed"
WINDOW = ["--dedup-window", "1d"]


def park(db, event_id, age_s):
    """A row parked failed by the relay, created age_s seconds ago."""
    db.execute("UPDATE idem.event_outbox SET status = 'failed', attempts = 8, last_error = 'nacked', "
               "next_attempt_at = now() + interval '1 hour', "
               "created_at = now() - %s * interval '1 second' WHERE event_id = %s", age_s, event_id)


def test_a_row_replay_accepts_at_the_window_edge_is_applied(db, servers, queue, consumers,
                                                            dead_letters):
    c = consumers("billing", queue, db, args=WINDOW)
    body = payload()
    eid = emit(db, TYPE, body)
    park(db, eid, 86_370)
    r = idem(db, servers, "replay", "--event-id", eid, *WINDOW)
    assert r.returncode == 0, r.stderr
    r = relay_once(db, servers)
    assert r.returncode == 0, r.stderr
    c.wait_handled(1, timeout=20)
    assert c.metric("idem_consumer_applied_total") == 1, c.log()
    assert c.metric("idem_consumer_dead_lettered_total") == 0
    assert c.stop() == 0
    assert db.ledger("billing") == [("billing", eid)]
    assert db.dunning_step(body["subscription_id"]) == 1
    assert dead_letters(queue).poll() == []


def test_one_second_past_the_window_both_refuse(db, servers, queue, consumers, broker,
                                                dead_letters):
    eid = emit(db, TYPE, payload())
    park(db, eid, 86_402)
    r = idem(db, servers, "replay", "--event-id", eid, *WINDOW)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "dedup window" in r.stderr
    # the consumer dead-letters a delivery of the same age as stale
    c = consumers("billing", queue, db, args=WINDOW)
    sid = broker.publish_event(TYPE, payload(), timestamp=int(time.time()) - 86_402)
    letters = dead_letters(queue).wait(1)
    assert letters[0].props.message_id == sid
    assert letters[0].error.startswith("stale: "), letters[0].error
    assert c.stop() == 0


def test_a_future_timestamp_keeps_its_ledger_row_past_the_window(db, servers, queue, consumers,
                                                                 broker, dead_letters):
    c = consumers("billing", queue, db, args=WINDOW)
    body = payload()
    eid = new_id()
    ts = int(time.time()) - 2 * 3600  # 23 h in the future when it was consumed 25 h ago
    broker.publish_event(TYPE, body, event_id=eid, timestamp=ts)
    c.wait_metric("idem_consumer_applied_total", 1)
    db.execute("UPDATE idem.consumed_events SET consumed_at = now() - interval '25 hours' "
               "WHERE event_id = %s", eid)
    r = idem(db, servers, "retain", "--outbox-keep", "1d", *WINDOW)
    assert r.returncode == 0, r.stderr
    assert "consumed_events: deleted 0 rows" in r.stdout, r.stdout
    # the broker delivers it again (a requeue from the DLQ, a publisher's retry): fresh, and a
    # duplicate of what was applied
    broker.publish_event(TYPE, body, event_id=eid, timestamp=ts)
    c.wait_metric("idem_consumer_duplicates_total", 1)
    assert c.metric("idem_consumer_applied_total") == 1
    assert c.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert dead_letters(queue).poll() == []
    # two days on, its row goes
    db.execute("UPDATE idem.consumed_events SET consumed_at = now() - interval '49 hours'")
    r = idem(db, servers, "retain", "--outbox-keep", "1d", *WINDOW)
    assert r.returncode == 0, r.stderr
    assert "consumed_events: deleted 1 rows" in r.stdout, r.stdout
    wait_until(lambda: db.count("idem.consumed_events") == 0 or None, 5, 0.1, "the row deleted")
