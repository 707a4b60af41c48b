-- Emitting at the database's pace, and no lock another role can take.
--
-- idem_relay_idle: a relay that found nothing to do for a while writes the row of its control
-- connection here and waits for a NOTIFY; a busy relay deletes it and polls every few
-- milliseconds (src/relay_wake.c). idem_emit notifies only while a row is here, so emitters'
-- commits are not serialised by the NOTIFY queue's lock while relays are busy. Unlogged: only a
-- hint (a stale row makes emitters notify, as they always did).
CREATE UNLOGGED TABLE idem.idem_relay_idle (
    pid integer PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);

-- idem_emit_locks: one row per subscription that ever emitted, locked (FOR UPDATE) by idem_emit to
-- the end of the emitting transaction, so that seq order is commit order within a subscription.
-- It replaces an advisory lock, which any role that can connect could take and hold; a row lock
-- needs UPDATE on the table, which only idem's owner has.
CREATE TABLE idem.idem_emit_locks (
    subscription_id uuid PRIMARY KEY
);
INSERT INTO idem.idem_emit_locks (subscription_id)
SELECT DISTINCT subscription_id FROM idem.event_outbox ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION idem.idem_emit(event_type text, subscription_id uuid, dedup_key text, payload jsonb,
                               headers jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_event_id uuid;
    v_type text;
    v_sub uuid;
    v_name text;
    v_timeout text;
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
    -- the subscription's order lock: a row only idem's owner can lock, held to the end of the
    -- caller's transaction; a wait behind another emitter of the subscription is bounded
    v_timeout := current_setting('lock_timeout');
    IF v_timeout = '0' THEN
        PERFORM set_config('lock_timeout', '60s', true);
    END IF;
    PERFORM 1 FROM idem_emit_locks l WHERE l.subscription_id = idem_emit.subscription_id
        FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO idem_emit_locks (subscription_id) VALUES (idem_emit.subscription_id)
        ON CONFLICT DO NOTHING;
        PERFORM 1 FROM idem_emit_locks l WHERE l.subscription_id = idem_emit.subscription_id
            FOR UPDATE;
    END IF;
    IF v_timeout = '0' THEN
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
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
    -- wake a relay only if one waits for it (src/relay_wake.c): a NOTIFY makes PostgreSQL commit
    -- notifying transactions one at a time; a busy relay polls
    IF FOUND AND EXISTS (SELECT 1 FROM idem_relay_idle) THEN
        PERFORM pg_notify('idem_outbox', '');
    END IF;
    RETURN v_event_id;
END
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_relay') THEN
        GRANT SELECT, INSERT, DELETE ON idem.idem_relay_idle TO idem_relay;
    END IF;
END
$$;
