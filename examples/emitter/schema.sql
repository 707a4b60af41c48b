-- The refund emitter's business table. Apply after `idem migrate` (which creates the outbox and
-- idem.idem_emit): psql "$IDEM_PG_URL" -f schema.sql

-- One row per refund request; request_key is the caller's idempotency key, so a retried
-- request finds its row instead of refunding twice.
CREATE TABLE IF NOT EXISTS refunds (
    refund_id       uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    request_key     text NOT NULL UNIQUE,
    subscription_id uuid NOT NULL,
    amount_cents    bigint NOT NULL CHECK (amount_cents > 0),
    currency        text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    created_at      timestamptz NOT NULL DEFAULT now()
);
