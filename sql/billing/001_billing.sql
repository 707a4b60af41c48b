-- Tables of the bundled billing handlers (handlers/), in schema billing; applied only by
-- `idem migrate --billing`. IF NOT EXISTS: a database migrated by an older idem had them in its
-- own schema, and sql/010_schema_idem.sql moved them here.
CREATE SCHEMA IF NOT EXISTS billing;
REVOKE CREATE ON SCHEMA billing FROM PUBLIC;

CREATE TABLE IF NOT EXISTS billing.dunning (
    subscription_id uuid        PRIMARY KEY,
    step            int         NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    last_event_id   uuid
);

CREATE TABLE IF NOT EXISTS billing.revenue_entries (
    entry_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    invoice_id      uuid        NOT NULL,
    subscription_id uuid        NOT NULL,
    amount_cents    bigint      NOT NULL CHECK (amount_cents >= 0),
    currency        text        NOT NULL,
    event_id        uuid        NOT NULL,
    recognized_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS revenue_entries_invoice ON billing.revenue_entries (invoice_id);

CREATE TABLE IF NOT EXISTS billing.receipts (
    receipt_id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    invoice_id      uuid        NOT NULL,
    subscription_id uuid        NOT NULL,
    event_id        uuid        NOT NULL,
    sent_at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS receipts_invoice ON billing.receipts (invoice_id);

-- The bundled handlers run as the consumer role (sql/005_roles.sql).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
        GRANT USAGE ON SCHEMA billing TO idem_consumer;
        GRANT SELECT, INSERT, UPDATE ON billing.dunning TO idem_consumer;
        GRANT INSERT ON billing.revenue_entries, billing.receipts TO idem_consumer;
    END IF;
END
$$;
