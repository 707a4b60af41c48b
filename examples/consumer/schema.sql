-- The refund consumer's own tables. Apply after `idem migrate` (which creates the dedup ledger
-- the consumer claims event ids in): psql "$IDEM_PG_URL" -f schema.sql

-- One row per refund credited: written by the refund.issued handler in the transaction that
-- claims the event, so a redelivered event finds its id in the ledger and writes nothing.
CREATE TABLE IF NOT EXISTS refund_credits (
    refund_id       uuid PRIMARY KEY,
    subscription_id uuid NOT NULL,
    amount_cents    bigint NOT NULL,
    currency        text NOT NULL,
    event_id        uuid NOT NULL,
    traceparent     text, -- the W3C trace context the emitting request carried, if any
    credited_at     timestamptz NOT NULL DEFAULT now()
);

-- The running credit balance per subscription and currency: an increment, which a second
-- application of the same event would visibly double.
CREATE TABLE IF NOT EXISTS credit_balances (
    subscription_id uuid NOT NULL,
    currency        text NOT NULL,
    balance_cents   bigint NOT NULL,
    PRIMARY KEY (subscription_id, currency)
);
