"""A relay drains a backlog its statistics do not know of at the usual cost: a claim's rows after
each head and the batch's sent marks stay probes, whatever the planner believes.

A relay prepares each statement on its connections once, planned generically, and keeps the plan
until the table's statistics change. Planned from statistics taken while next to nothing was
pending (the usual state of an outbox, until a broker outage or a burst; or a TRUNCATE), every
index of pending rows looked as cheap as any other, and two plans read every pending row on each
call:
- step 2 of the claim (a subscription's rows after its head, in seq order) walked an index on seq
  alone, filtering on the subscription, once for every head of the batch, and so did the look for
  each row's previous pending row: 100-400 ms a claim with a few thousand rows pending (bench
  latency phase at 1,000/s, claims of 1-2 ms before);
- the sent marks (by ctid) scanned an index of pending rows filtering on the ctids: 66 ms for a
  batch of 200 with 4,000 pending.
The relay fell further behind with every claim: emit-to-effect at 1,000/s went from 15 ms to 2 s
within 15 s.

Here 60,000 sent rows and one pending row are ANALYZEd (autovacuum off for the outbox, so the
statistics stay as they are). Then 40,000 rows are made pending, in one seq order: 2,000 due rows
of 100 subscriptions (so a claim finds at most half a batch of heads, and step 2 runs for each),
one in every 20, between 38,000 rows of 100 subscriptions whose first row waits for a retry an
hour away (nobody may claim them; they stay pending throughout, as behind a poison row). One relay
must publish the due rows within DRAIN_BOUND_S, with the median claim under CLAIM_BOUND_MS and the
median mark and commit under MARK_BOUND_MS. Measured: 6 ms and 5-8 ms; with the old plans, where
each claim read about 2,000 pending rows for each row it took and each mark every pending row,
42-49 ms and 48-78 ms."""

import statistics
import time

from conftest import new_id, wait_until
from relay_helpers import declare_consumer_queue, insert_rows, relay_daemons, status_counts

__all__ = ["relay_daemons"]

TYPE = "payment.failed"
SENT = 60000
STRIDE = 20  # one due row in every STRIDE pending rows
DUE_SUBS, DUE_PER_SUB = 100, 20
WAIT_SUBS, WAIT_PER_SUB = 100, 380
DRAIN_BOUND_S = 30
CLAIM_BOUND_MS = 20
MARK_BOUND_MS = 20

AUTOANALYZED = ("SELECT autoanalyze_count + autovacuum_count FROM pg_stat_user_tables"
                " WHERE relid = 'idem.event_outbox'::regclass")


# Due rows (i % STRIDE = 0) between waiting ones, in seq order; each waiting subscription's first
# row waits for a retry (its head is passed over, and the rows behind it wait with it).
BACKLOG = """
INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload, attempts,
                               next_attempt_at)
SELECT gen_random_uuid(), x.sub, %(type)s,
       jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id', x.sub,
                          'amount_cents', 100, 'currency', 'USD', 'n', x.i),
       CASE WHEN x.first THEN 1 ELSE 0 END,
       CASE WHEN x.first THEN now() + interval '1 hour' ELSE now() END
  FROM (SELECT i, CASE WHEN i %% %(k)s = 0 THEN (%(due)s::uuid[])[1 + (i / %(k)s) %% %(ndue)s]
                       ELSE (%(wait)s::uuid[])[1 + (i - 1 - i / %(k)s) %% %(nwait)s] END AS sub,
               i %% %(k)s <> 0 AND i - 1 - i / %(k)s < %(nwait)s AS first
          FROM generate_series(1, %(n)s) AS i) x
 ORDER BY x.i"""


def pending_estimate(db):
    """The planner's estimate of the pending rows."""
    plan = db.scalar("EXPLAIN (FORMAT JSON) SELECT * FROM idem.event_outbox"
                     " WHERE status = 'pending'")
    return plan[0]["Plan"]["Plan Rows"]


def test_a_backlog_unknown_to_the_statistics_is_claimed_and_marked_by_probes(db, broker, queue,
                                                                           relay_daemons):
    declare_consumer_queue(broker, queue, [TYPE])
    due = [new_id() for _ in range(DUE_SUBS)]
    wait = [new_id() for _ in range(WAIT_SUBS)]
    ndue, nwait = DUE_SUBS * DUE_PER_SUB, WAIT_SUBS * WAIT_PER_SUB
    assert nwait == (STRIDE - 1) * ndue
    db.execute("ALTER TABLE idem.event_outbox SET (autovacuum_enabled = off)")
    try:
        insert_rows(db, due, TYPE, "sent", SENT)
        insert_rows(db, due, TYPE, "pending", 1)
        db.execute("ANALYZE idem.event_outbox")
        with db.connect() as conn, conn.cursor() as cur:
            cur.execute(BACKLOG, {"type": TYPE, "due": due, "ndue": DUE_SUBS, "wait": wait,
                                  "nwait": WAIT_SUBS, "k": STRIDE, "n": ndue + nwait - 1})
        assert status_counts(db).get("pending") == ndue + nwait
        assert db.count("idem.event_outbox",
                        "status = 'pending' AND subscription_id = ANY(%s::uuid[])", due) == ndue
        # what the planner believes: (next to) nothing pending
        assert pending_estimate(db) <= 10
        analyzed = db.scalar(AUTOANALYZED)

        t0 = time.monotonic()
        relay = relay_daemons(["--poll-interval", "50ms"])
        wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == SENT + ndue,
                   DRAIN_BOUND_S, 0.2,
                   lambda: f"{ndue} due rows published within {DRAIN_BOUND_S} s "
                   f"(now {status_counts(db)})")
        took = time.monotonic() - t0
        assert db.count("idem.event_outbox", "status = 'pending'") == nwait
        # the statistics were not refreshed meanwhile: the run used the plans made from them
        assert db.scalar(AUTOANALYZED) == analyzed
        assert pending_estimate(db) <= 10

        batches = [b for b in relay.batch_lines() if b["claimed"] > 0]
        assert batches, relay.log()[-2000:]
        claim = statistics.median(b["claim_ms"] for b in batches)
        mark = statistics.median(b["mark_commit_ms"] for b in batches)
        print(f"{ndue} rows in {took:.1f} s, {len(batches)} batches, median claim {claim} ms, "
              f"mark + commit {mark} ms")
        assert claim <= CLAIM_BOUND_MS, f"median claim {claim} ms over {len(batches)} batches"
        assert mark <= MARK_BOUND_MS, f"median mark + commit {mark} ms over {len(batches)} batches"
    finally:
        db.execute("ALTER TABLE idem.event_outbox RESET (autovacuum_enabled)")
