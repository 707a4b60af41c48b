-- Tables of the bundled billing handlers (handlers/).
CREATE TABLE dunning (
    subscription_id uuid        PRIMARY KEY,
    step            int         NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    last_event_id   uuid
);

CREATE TABLE revenue_entries (
    entry_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    invoice_id      uuid        NOT NULL,
    subscription_id uuid        NOT NULL,
    amount_cents    bigint      NOT NULL CHECK (amount_cents >= 0),
    currency        text        NOT NULL,
    event_id        uuid        NOT NULL,
    recognized_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX revenue_entries_invoice ON revenue_entries (invoice_id);

CREATE TABLE receipts (
    receipt_id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    invoice_id      uuid        NOT NULL,
    subscription_id uuid        NOT NULL,
    event_id        uuid        NOT NULL,
    sent_at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX receipts_invoice ON receipts (invoice_id);
