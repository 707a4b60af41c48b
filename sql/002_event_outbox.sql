-- The transactional outbox. seq gives a strict order (created_at ties for rows of one
-- transaction); next_attempt_at schedules retries. status: pending | sent | failed.
CREATE TABLE idem.event_outbox (
    outbox_id       uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    seq             bigint      GENERATED ALWAYS AS IDENTITY,
    event_id        uuid        NOT NULL UNIQUE,
    subscription_id uuid        NOT NULL,
    event_type      text        NOT NULL CHECK (event_type <> ''),
    payload         jsonb       NOT NULL CHECK (jsonb_typeof(payload) = 'object'),
    status          text        NOT NULL DEFAULT 'pending'
                                CHECK (status IN ('pending', 'sent', 'failed')),
    attempts        int         NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    last_error      text
);

-- The relay's scan: exactly the non-terminal rows, in emit order. Any new non-terminal status
-- must be added to these predicates in the same migration.
CREATE INDEX event_outbox_pending ON idem.event_outbox (seq) WHERE status = 'pending';
-- A subscription's first pending row, for the relay's head check (one index probe).
CREATE INDEX event_outbox_pending_sub ON idem.event_outbox (subscription_id, seq)
    WHERE status = 'pending';
-- Head-of-line check per subscription: pending rows that have failed at least once are the only
-- ones that can wait for a later attempt, so this index stays as small as the retry backlog.
CREATE INDEX event_outbox_retrying ON idem.event_outbox (subscription_id, seq)
    WHERE status = 'pending' AND attempts > 0;
-- Retention of sent rows by age, and the operator's list of parked rows.
CREATE INDEX event_outbox_sent_at ON idem.event_outbox (sent_at) WHERE status = 'sent';
CREATE INDEX event_outbox_failed ON idem.event_outbox (created_at) WHERE status = 'failed';

-- Queues one event in the caller's transaction. The event id is md5(dedup_key)::uuid, so a
-- replay of the same business operation collapses into the same row. A per-subscription
-- transaction lock makes seq order equal commit order for one subscription, so relays can
-- publish a subscription's events in emit order. The NOTIFY is delivered at commit.
CREATE FUNCTION idem.idem_emit(event_type text, subscription_id uuid, dedup_key text, payload jsonb)
RETURNS uuid
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_event_id uuid;
BEGIN
    IF dedup_key IS NULL OR dedup_key = '' THEN
        RAISE EXCEPTION 'idem_emit: dedup_key must not be empty' USING ERRCODE = '22023';
    END IF;
    IF subscription_id IS NULL THEN
        RAISE EXCEPTION 'idem_emit: subscription_id must not be null' USING ERRCODE = '22023';
    END IF;
    v_event_id := md5(dedup_key)::uuid;
    PERFORM pg_advisory_xact_lock(7648, hashtext(subscription_id::text));
    INSERT INTO event_outbox AS o (event_id, subscription_id, event_type, payload)
    VALUES (v_event_id, idem_emit.subscription_id, idem_emit.event_type, idem_emit.payload)
    ON CONFLICT ON CONSTRAINT event_outbox_event_id_key DO NOTHING;
    IF FOUND THEN
        PERFORM pg_notify('idem_outbox', '');
    END IF;
    RETURN v_event_id;
END
$$;
