-- The dedup ledger: one row per (consumer, event) a consumer has applied. The primary key is
-- the claim: INSERT ... ON CONFLICT DO NOTHING inside the consumer's transaction.
CREATE TABLE idem.consumed_events (
    consumer    text        NOT NULL,
    event_id    uuid        NOT NULL,
    consumed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention deletes by age in bounded batches.
CREATE INDEX consumed_events_consumed_at ON idem.consumed_events (consumed_at);
