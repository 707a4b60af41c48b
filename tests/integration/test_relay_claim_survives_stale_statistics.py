"""A backlog that the planner's statistics do not know of is drained at the claim's usual cost.

The outbox usually has next to nothing pending, so that is what autovacuum's ANALYZE records.
Then a burst or a broker outage leaves a backlog, and the relay's claim is planned from those
statistics (at its first run on a connection, or again after any ANALYZE). Before the claim
forbade sorts (src/relay/relay_claim.c, SQL_SETTINGS), the cheapest-looking plan read every pending
row through the index on seq and sorted them, in each of a claim's 200 probes: measured 2.9 s a
claim with 30,000 pending rows (9 ms with the fix). Under a steady 1,500 events/s the relay fell
behind and never caught up (bench steady phase: 59,000 pending after a minute).

Here: 60,000 sent rows and one pending row are ANALYZEd (autovacuum off for the outbox, so the
statistics stay as they are), then 20,000 rows of 500 subscriptions are made pending. One relay
must publish them all within DRAIN_BOUND_S; with the old plan it took minutes.

With such statistics the two plans are a near tie, and which one wins depends on ANALYZE's sample
and the table's size (seen here: the sorting plan at 60,000 sent rows in three data sets of four,
the index walk at 20,000 and at 100,000). So the backlog is inserted in a transaction left open
while ANALYZE runs (its rows take their pages but are not counted), ANALYZE is repeated until the
probe is planned with a sort (up to ATTEMPTS times), and only then is the backlog committed: the
relay's claim must refuse that plan to pass."""

import time

from conftest import new_id, wait_until
from relay_helpers import declare_consumer_queue, insert_rows, relay_daemons, status_counts

__all__ = ["relay_daemons"]

TYPE = "payment.failed"
SENT = 60000
PENDING = 20000
SUBS = 500
DRAIN_BOUND_S = 30
ATTEMPTS = 20

# One probe of the claim's walk, planned as the relay plans it (generic), with sorts allowed: the
# plan the statistics lead to.
PROBE = """
BEGIN;
SET LOCAL plan_cache_mode = force_generic_plan;
PREPARE probe(uuid) AS
  SELECT o.subscription_id, o.seq, o.ctid, o.next_attempt_at <= now() FROM idem.event_outbox o WHERE o.status = 'pending' AND o.subscription_id > $1
   ORDER BY o.subscription_id, o.seq LIMIT 1;
EXPLAIN EXECUTE probe('00000000-0000-0000-0000-000000000000');
"""


def probe_plan(db):
    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute(PROBE)
        plan = "\n".join(r[0] for r in cur.fetchall())
        conn.rollback()
    return plan


AUTOANALYZED = ("SELECT autoanalyze_count FROM pg_stat_user_tables"
                " WHERE relid = 'idem.event_outbox'::regclass")


def test_a_backlog_unknown_to_the_statistics_drains_at_the_usual_cost(db, broker, queue,
                                                                     relay_daemons):
    declare_consumer_queue(broker, queue, [TYPE])
    subs = [new_id() for _ in range(SUBS)]
    db.execute("ALTER TABLE idem.event_outbox SET (autovacuum_enabled = off)")
    try:
        insert_rows(db, subs, TYPE, "sent", SENT)
        insert_rows(db, subs, TYPE, "pending", 1)
        with db.connect(autocommit=False) as burst, burst.cursor() as cur:
            insert_rows(db, subs, TYPE, "pending", PENDING - 1, cur=cur)
            # what the planner is to believe: (next to) nothing pending; and the plan it makes
            for _ in range(ATTEMPTS):
                db.execute("ANALYZE idem.event_outbox")
                plan = probe_plan(db)
                if "event_outbox_pending_sub" not in plan:
                    break
            assert "event_outbox_pending_sub" not in plan and "Sort" in plan, plan
            analyzed = db.scalar(AUTOANALYZED)
            burst.commit()
        assert status_counts(db).get("pending") == PENDING

        t0 = time.monotonic()
        relay_daemons(["--poll-interval", "50ms"])
        total = SENT + PENDING
        wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == total,
                   DRAIN_BOUND_S, 0.2,
                   lambda: f"{PENDING} rows published within {DRAIN_BOUND_S} s "
                   f"(now {status_counts(db)})")
        took = time.monotonic() - t0
        print(f"{PENDING} pending rows published in {took:.1f} s")
        # the statistics were not refreshed meanwhile: the run used the plan made from them
        assert db.scalar(AUTOANALYZED) == analyzed
    finally:
        db.execute("ALTER TABLE idem.event_outbox RESET (autovacuum_enabled)")
