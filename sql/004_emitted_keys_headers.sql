-- The record of emitted event ids. A replay of a business operation must collapse into the event
-- it first produced for as long as consumers could apply it again: that is longer than the outbox
-- keeps its rows (`retain --outbox-keep`), so the keys live in a table of their own, aged from the
-- first emit and deleted by `retain --keys-keep`.
CREATE TABLE idem.idem_emitted_keys (
    event_id         uuid        PRIMARY KEY,
    event_type       text        NOT NULL,
    subscription_id  uuid        NOT NULL,
    first_emitted_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idem_emitted_keys_first_emitted_at ON idem.idem_emitted_keys (first_emitted_at);

INSERT INTO idem.idem_emitted_keys (event_id, event_type, subscription_id, first_emitted_at)
SELECT event_id, event_type, subscription_id, created_at FROM idem.event_outbox
ON CONFLICT DO NOTHING;

-- Message headers given at emit time (a flat JSON object of strings, e.g. traceparent); the relay
-- publishes them beside its own.
ALTER TABLE idem.event_outbox ADD COLUMN headers jsonb
    CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object');

DROP FUNCTION idem.idem_emit(text, uuid, text, jsonb);

-- Queues one event in the caller's transaction. The event id is md5(dedup_key)::uuid: a replay
-- of the same operation (same key, type and subscription) inserts nothing and returns the same
-- id; the same key with another type or subscription is an error (23505), never a silent drop.
-- A per-subscription transaction lock makes seq order equal commit order for one subscription.
-- The NOTIFY is delivered at commit.
CREATE FUNCTION idem.idem_emit(event_type text, subscription_id uuid, dedup_key text, payload jsonb,
                               headers jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_event_id uuid;
    v_type text;
    v_sub uuid;
    v_name text;
BEGIN
    IF dedup_key IS NULL OR dedup_key = '' THEN
        RAISE EXCEPTION 'idem_emit: dedup_key must not be empty' USING ERRCODE = '22023';
    END IF;
    IF subscription_id IS NULL THEN
        RAISE EXCEPTION 'idem_emit: subscription_id must not be null' USING ERRCODE = '22023';
    END IF;
    -- The event type is the AMQP routing key and type property: short strings of 1-255 bytes.
    IF event_type IS NULL OR octet_length(event_type) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'idem_emit: event_type must be 1-255 bytes, got %',
            coalesce(octet_length(event_type), 0) USING ERRCODE = '22023';
    END IF;
    IF payload IS NULL OR jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'idem_emit: payload must be a JSON object' USING ERRCODE = '22023';
    END IF;
    IF headers IS NOT NULL THEN
        IF jsonb_typeof(headers) <> 'object' THEN
            RAISE EXCEPTION 'idem_emit: headers must be a JSON object of strings'
                USING ERRCODE = '22023';
        END IF;
        FOR v_name IN SELECT k FROM jsonb_object_keys(headers) AS k LOOP
            IF jsonb_typeof(headers -> v_name) <> 'string' THEN
                RAISE EXCEPTION 'idem_emit: header "%" must be a string', v_name
                    USING ERRCODE = '22023';
            END IF;
            IF octet_length(v_name) NOT BETWEEN 1 AND 255 THEN
                RAISE EXCEPTION 'idem_emit: header names must be 1-255 bytes'
                    USING ERRCODE = '22023';
            END IF;
            IF lower(v_name) LIKE 'x-idem-%' THEN
                RAISE EXCEPTION 'idem_emit: header "%" is reserved (x-idem-*)', v_name
                    USING ERRCODE = '22023';
            END IF;
            -- RabbitMQ's sender-selected routing headers must be arrays; a string is refused
            IF v_name IN ('CC', 'BCC') THEN
                RAISE EXCEPTION 'idem_emit: header "%" is RabbitMQ''s sender-selected routing',
                    v_name USING ERRCODE = '22023';
            END IF;
        END LOOP;
        IF headers = '{}'::jsonb THEN
            headers := NULL;
        END IF;
    END IF;
    v_event_id := md5(dedup_key)::uuid;
    PERFORM pg_advisory_xact_lock(7648, hashtext(subscription_id::text));
    INSERT INTO idem_emitted_keys (event_id, event_type, subscription_id)
    VALUES (v_event_id, idem_emit.event_type, idem_emit.subscription_id)
    ON CONFLICT (event_id) DO NOTHING;
    IF NOT FOUND THEN
        SELECT k.event_type, k.subscription_id INTO v_type, v_sub
          FROM idem_emitted_keys k WHERE k.event_id = v_event_id;
        IF v_type IS DISTINCT FROM idem_emit.event_type
           OR v_sub IS DISTINCT FROM idem_emit.subscription_id THEN
            RAISE EXCEPTION 'idem_emit: dedup key already used for a % event of subscription %',
                v_type, v_sub
                USING ERRCODE = '23505',
                      DETAIL = format('event id %s', v_event_id);
        END IF;
        RETURN v_event_id; -- a replay: the event exists (or existed) already
    END IF;
    INSERT INTO event_outbox AS o (event_id, subscription_id, event_type, payload, headers)
    VALUES (v_event_id, idem_emit.subscription_id, idem_emit.event_type, idem_emit.payload,
            idem_emit.headers)
    ON CONFLICT ON CONSTRAINT event_outbox_event_id_key DO NOTHING;
    IF FOUND THEN
        PERFORM pg_notify('idem_outbox', '');
    END IF;
    RETURN v_event_id;
END
$$;
