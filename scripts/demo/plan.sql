-- Seeds the demo's business data and scripts the workload (deterministic: fixed random seed).
-- psql variables: dunning_subs, paying_subs, recovering_subs (subscription counts per story),
-- ticks (length of phase 1 in 100 ms steps), replay_pct (share of operations re-run with the
-- same dedup key).
\set ON_ERROR_STOP 1
SELECT setseed(0.4242);

INSERT INTO demo.subs (subscription_id, sub_no, story)
SELECT md5('demo-subscription-' || n)::uuid, n,
       CASE WHEN n <= :dunning_subs THEN 'dunning'
            WHEN n <= :dunning_subs + :paying_subs THEN 'paying'
            ELSE 'recovering' END
FROM generate_series(1, :dunning_subs + :paying_subs + :recovering_subs) AS n;

INSERT INTO subscriptions (subscription_id, customer)
SELECT subscription_id, 'customer-' || sub_no FROM demo.subs ORDER BY sub_no;

-- Invoices: 7 per dunning subscription, 15 per paying one, 1 per recovering one.
CREATE TEMP TABLE inv AS
SELECT md5('demo-invoice-' || s.sub_no || '-' || i)::uuid AS invoice_id, s.subscription_id,
       s.sub_no, s.story, i AS inv_no
FROM demo.subs s
CROSS JOIN LATERAL generate_series(1, CASE s.story WHEN 'dunning' THEN 7
                                                   WHEN 'paying' THEN 15 ELSE 1 END) AS i
ORDER BY s.sub_no, i;

CREATE TEMP TABLE inv_plan AS
SELECT invoice_id, subscription_id, sub_no, story,
       (500 + floor(random() * 19500))::bigint AS amount_cents,
       (ARRAY['USD', 'EUR', 'GBP'])[1 + floor(random() * 3)::int] AS currency,
       -- how many payment attempts fail (dunning: 1-4, recovering: 1-3, paying: none)
       CASE story WHEN 'dunning' THEN 1 + floor(random() * 4)::int
                  WHEN 'recovering' THEN 1 + floor(random() * 3)::int ELSE 0 END AS failures
FROM inv ORDER BY sub_no, inv_no;

INSERT INTO invoices (invoice_id, subscription_id, amount_cents, currency)
SELECT invoice_id, subscription_id, amount_cents, currency FROM inv_plan ORDER BY sub_no, invoice_id;

-- Phase 1, sessions 1 and 2 (split by subscription), :ticks steps long:
--   paying subscriptions' invoices are paid at random times;
--   dunning invoices fail attempt k in the k-th quarter of the phase;
--   recovering invoices fail attempt k within [2.5 s * (k-1), 2.5 s * k), so by 7.5 s.
INSERT INTO demo.ops (session, tick, kind, invoice_id, attempt_no)
SELECT 1 + sub_no % 2, floor(random() * :ticks)::int, 'pay', invoice_id, NULL
FROM inv_plan WHERE story = 'paying' ORDER BY sub_no, invoice_id;

INSERT INTO demo.ops (session, tick, kind, invoice_id, attempt_no)
SELECT 1 + p.sub_no % 2,
       CASE p.story WHEN 'dunning' THEN floor((k - 1 + random()) * :ticks / 4)::int
                    ELSE floor((k - 1 + random()) * 25)::int END,
       'fail', p.invoice_id, k
FROM inv_plan p CROSS JOIN LATERAL generate_series(1, p.failures) AS k
ORDER BY p.sub_no, p.invoice_id, k;

-- Phase 2, session 3: the recovering subscriptions pay, over 3 s, once all their failures
-- have been consumed (scripts/demo.py waits for that before starting the session).
INSERT INTO demo.ops (session, tick, kind, invoice_id, attempt_no)
SELECT 3, floor(random() * 30)::int, 'pay', invoice_id, NULL
FROM inv_plan WHERE story = 'recovering' ORDER BY sub_no, invoice_id;

-- Replays: about :replay_pct % of the operations run again 0.5-3 s later, same dedup key
-- (a client retrying after a timeout, a webhook delivered twice, a double click...).
INSERT INTO demo.ops (session, tick, kind, invoice_id, attempt_no, is_replay)
SELECT session,
       LEAST(tick + 5 + floor(random() * 26)::int, CASE WHEN session = 3 THEN 29 ELSE :ticks - 1 END),
       kind, invoice_id, attempt_no, true
FROM (SELECT * FROM demo.ops ORDER BY op_id) o
WHERE random() < :replay_pct / 100.0;

INSERT INTO demo.progress (session) VALUES (1), (2), (3);

-- The expected outcome, from the business plan alone (never from idem's tables).
CREATE TABLE demo.expected_dunning AS
SELECT s.subscription_id, s.story,
       CASE s.story WHEN 'recovering' THEN 0
                    ELSE (SELECT coalesce(sum(failures), 0) FROM inv_plan p
                          WHERE p.subscription_id = s.subscription_id) END AS step,
       (SELECT coalesce(sum(failures), 0) FROM inv_plan p
        WHERE p.subscription_id = s.subscription_id) AS failures
FROM demo.subs s;

CREATE TABLE demo.expected_paid AS
SELECT invoice_id, subscription_id, amount_cents, currency
FROM inv_plan WHERE story IN ('paying', 'recovering');
