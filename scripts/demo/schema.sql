-- The demo's own business schema: a tiny subscription billing app that uses idem.
-- (idem's own tables come from `idem migrate`; nothing here is part of idem.)

CREATE TABLE subscriptions (
    subscription_id uuid PRIMARY KEY,
    customer        text NOT NULL
);

CREATE TABLE invoices (
    invoice_id      uuid   PRIMARY KEY,
    subscription_id uuid   NOT NULL REFERENCES subscriptions,
    amount_cents    bigint NOT NULL CHECK (amount_cents >= 0),
    currency        text   NOT NULL,
    status          text   NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'paid', 'failed')),
    failed_attempts int    NOT NULL DEFAULT 0,
    paid_at         timestamptz
);
CREATE INDEX invoices_subscription ON invoices (subscription_id);

-- The payload idem's bundled billing handlers expect, built from the business row.
CREATE VIEW invoice_events AS
SELECT invoice_id, subscription_id,
       jsonb_build_object('invoice_id', invoice_id, 'subscription_id', subscription_id,
                          'amount_cents', amount_cents, 'currency', currency) AS payload
FROM invoices;

-- The demo harness (not business data): the scripted workload and its progress counters.
CREATE SCHEMA demo;

-- One row per subscription: which story it plays.
--   dunning    - only payment.failed events      -> expect dunning.step = its distinct failures
--   paying     - only invoice.paid events        -> expect one revenue entry + one receipt per
--                                                    invoice, and no dunning row
--   recovering - fails first; pays once every one of its failures has been consumed
--                                                 -> expect dunning.step = 0, revenue + receipt
CREATE TABLE demo.subs (
    subscription_id uuid PRIMARY KEY,
    sub_no          int  NOT NULL UNIQUE,
    story           text NOT NULL CHECK (story IN ('dunning', 'paying', 'recovering'))
);

-- One row per business operation the workload runs (replays are extra rows, is_replay = true).
-- session: which psql session runs it (1 and 2: phase 1; 3: the recovering subscriptions' payments,
-- phase 2); tick: when, in 100 ms steps from the session's start.
CREATE TABLE demo.ops (
    op_id      int  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session    int  NOT NULL,
    tick       int  NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('pay', 'fail')),
    invoice_id uuid NOT NULL,
    attempt_no int,
    is_replay  bool NOT NULL DEFAULT false
);

-- Operations committed so far, per session (bumped inside each business transaction).
CREATE TABLE demo.progress (
    session int PRIMARY KEY,
    ops     int NOT NULL DEFAULT 0
);
