-- The demo's audit: idem's effects compared with the business plan (demo.ops, demo.expected_*).
-- One row per check: n, ok, what was checked, the numbers behind it. Run after everything
-- drained. psql variable: consumer (the consumer name in the ledger).
WITH planned AS (
    SELECT DISTINCT kind, invoice_id, attempt_no,
           CASE kind WHEN 'pay' THEN 'invoice.paid' ELSE 'payment.failed' END AS event_type,
           md5(invoice_id || CASE kind WHEN 'pay' THEN ':paid'
                                       ELSE ':failed:' || attempt_no END)::uuid AS event_id
    FROM demo.ops
),
ops AS (
    SELECT count(*) AS transactions, count(*) FILTER (WHERE is_replay) AS replays FROM demo.ops
),
emits AS (  -- planned operations, and those without their outbox event
    SELECT count(*) AS planned,
           count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM idem.event_outbox o
                                              WHERE o.event_id = p.event_id
                                                AND o.event_type = p.event_type)) AS missing
    FROM planned p
),
receipt_events AS (  -- paid invoices, and those without their receipt.requested event
    SELECT count(*) AS paid,
           count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM idem.event_outbox o
                                              WHERE o.event_id = md5('idem:' || md5(e.invoice_id || ':paid')::uuid::text
                                                                     || ':receipt')::uuid
                                                AND o.event_type = 'receipt.requested')) AS missing
    FROM demo.expected_paid e
),
outbox AS (
    SELECT count(*) AS events,
           count(*) FILTER (WHERE event_type IN ('invoice.paid', 'payment.failed')) AS business,
           count(*) FILTER (WHERE event_type = 'receipt.requested') AS receipts,
           count(*) FILTER (WHERE status = 'sent') AS sent,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM idem.consumed_events c
                                              WHERE c.consumer = :'consumer'
                                                AND c.event_id = o.event_id)) AS unconsumed
    FROM idem.event_outbox o
),
ledger AS (
    SELECT count(*) AS rows,
           count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM idem.event_outbox o
                                              WHERE o.event_id = c.event_id)) AS strays
    FROM idem.consumed_events c WHERE c.consumer = :'consumer'
),
dun AS (
    SELECT e.story, count(*) AS subs, sum(e.failures) AS failures,
           min(e.step) AS min_step, max(e.step) AS max_step,
           count(*) FILTER (WHERE d.step IS DISTINCT FROM e.step) AS mismatches,
           count(d.step) AS with_row
    FROM demo.expected_dunning e LEFT JOIN billing.dunning d USING (subscription_id)
    GROUP BY e.story
),
paid AS (
    SELECT count(*) AS invoices,
           count(*) FILTER (WHERE r.n <> 1 OR r.n_exact <> 1) AS bad_revenue,
           count(*) FILTER (WHERE r.n_receipts <> 1) AS bad_receipts
    FROM demo.expected_paid e
    CROSS JOIN LATERAL (
        SELECT (SELECT count(*) FROM billing.revenue_entries v WHERE v.invoice_id = e.invoice_id) AS n,
               (SELECT count(*) FROM billing.revenue_entries v WHERE v.invoice_id = e.invoice_id
                  AND v.subscription_id = e.subscription_id AND v.amount_cents = e.amount_cents
                  AND v.currency = e.currency
                  AND v.event_id = md5(e.invoice_id || ':paid')::uuid) AS n_exact,
               (SELECT count(*) FROM billing.receipts c WHERE c.invoice_id = e.invoice_id) AS n_receipts
    ) r
),
totals AS (
    SELECT (SELECT count(*) FROM billing.revenue_entries) AS revenue_rows,
           (SELECT count(*) FROM billing.receipts) AS receipt_rows
)
SELECT 1, emits.missing = 0 AND outbox.business = emits.planned,
       'one outbox event per business operation (replays collapsed)',
       format('%s transactions (%s replays) -> %s distinct operations -> %s events',
              ops.transactions, ops.replays, emits.planned, outbox.business)
FROM ops, emits, outbox
UNION ALL
SELECT 2, receipt_events.missing = 0 AND outbox.receipts = receipt_events.paid,
       'one receipt.requested event per paid invoice (emitted by the invoice.paid handler)',
       format('%s paid invoices -> %s receipt.requested events', receipt_events.paid, outbox.receipts)
FROM receipt_events, outbox
UNION ALL
SELECT 3, outbox.sent = outbox.events,
       'outbox fully published: no pending, no failed rows',
       format('%s sent, %s pending, %s failed', outbox.sent, outbox.pending, outbox.failed)
FROM outbox
UNION ALL
SELECT 4, ledger.rows = outbox.events AND outbox.unconsumed = 0 AND ledger.strays = 0,
       'every event exactly one ledger row (consumed_events)',
       format('%s events, %s ledger rows, %s events without a row',
              outbox.events, ledger.rows, outbox.unconsumed)
FROM outbox, ledger
UNION ALL
SELECT 5, mismatches = 0,
       'dunning subscriptions: step = their distinct payment failures',
       format('%s subscriptions, %s failures, %s mismatches (steps %s..%s)',
              subs, failures, mismatches, min_step, max_step)
FROM dun WHERE story = 'dunning'
UNION ALL
SELECT 6, mismatches = 0,
       'recovering subscriptions: failed, then paid -> dunning step back to 0',
       format('%s subscriptions, %s failures before paying, %s not at step 0',
              subs, failures, mismatches)
FROM dun WHERE story = 'recovering'
UNION ALL
SELECT 7, with_row = 0,
       'paying subscriptions: no dunning row',
       format('%s subscriptions, %s with a dunning row', subs, with_row)
FROM dun WHERE story = 'paying'
UNION ALL
SELECT 8, paid.bad_revenue = 0 AND totals.revenue_rows = paid.invoices,
       'revenue: exactly one entry per paid invoice (right amount, currency, event)',
       format('%s paid invoices, %s revenue entries, %s invoices without exactly one',
              paid.invoices, totals.revenue_rows, paid.bad_revenue)
FROM paid, totals
UNION ALL
SELECT 9, paid.bad_receipts = 0 AND totals.receipt_rows = paid.invoices,
       'receipts: exactly one per paid invoice',
       format('%s paid invoices, %s receipts, %s invoices without exactly one',
              paid.invoices, totals.receipt_rows, paid.bad_receipts)
FROM paid, totals
ORDER BY 1;
