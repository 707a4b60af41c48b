-- Whether a relay waits for a wake-up is a function of its own, idem_relay_waits(), which
-- idem_emit_event calls for a new row. 019 and 021 had to restate the whole emit to change that
-- one look; the next change to the relay's wake-up replaces this function alone. The look is
-- the one of 021: a row of idem_relay_idle counts while the session it names (pid and
-- application_name) lives. Only idem's owner executes it (from idem_emit, idem_emit_followup
-- and the statements that call them); like every idem function it pins its search_path.
CREATE FUNCTION idem.idem_relay_waits()
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
BEGIN
    -- a row whose session is gone (a relay killed while idle), or whose pid another session has
    -- since, wakes nobody and is not counted (021)
    RETURN EXISTS (SELECT 1 FROM idem_relay_idle i
                    WHERE EXISTS (SELECT 1 FROM pg_stat_get_activity(i.pid) a
                                   WHERE a.pid = i.pid AND a.application_name = i.app));
END
$$;
REVOKE EXECUTE ON FUNCTION idem.idem_relay_waits() FROM PUBLIC;

-- idem_emit: as in 021, the idle look in idem_relay_waits().
CREATE OR REPLACE FUNCTION idem.idem_emit_event(event_type text, subscription_id uuid,
                                                dedup_key text, payload jsonb, headers jsonb)
RETURNS uuid
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_event_id uuid;
    v_outbox uuid;
    v_type text;
    v_sub uuid;
    v_name text;
    v_timeout text;
BEGIN
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
    -- caller's transaction; a wait behind another emitter of the subscription (or on the
    -- outbox's unique index behind an emitter of the same key) is bounded
    v_timeout := current_setting('lock_timeout');
    IF v_timeout = '0' THEN
        PERFORM set_config('lock_timeout', '60s', true);
    END IF;
    PERFORM 1 FROM idem_emit_locks l WHERE l.subscription_id = idem_emit_event.subscription_id
        FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO idem_emit_locks (subscription_id) VALUES (idem_emit_event.subscription_id)
        ON CONFLICT DO NOTHING;
        PERFORM 1 FROM idem_emit_locks l WHERE l.subscription_id = idem_emit_event.subscription_id
            FOR UPDATE;
    END IF;
    INSERT INTO event_outbox AS o (event_id, subscription_id, event_type, payload, headers)
    VALUES (v_event_id, idem_emit_event.subscription_id, idem_emit_event.event_type,
            idem_emit_event.payload, idem_emit_event.headers)
    ON CONFLICT ON CONSTRAINT event_outbox_event_id_key DO NOTHING
    RETURNING o.outbox_id INTO v_outbox;
    IF v_timeout = '0' THEN
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
    IF v_outbox IS NULL THEN
        -- the id is in the outbox already
        SELECT o.event_type, o.subscription_id INTO v_type, v_sub
          FROM event_outbox o WHERE o.event_id = v_event_id;
        IF NOT FOUND THEN -- retention replaced the row by its key since
            SELECT k.event_type, k.subscription_id INTO v_type, v_sub
              FROM idem_emitted_keys k WHERE k.event_id = v_event_id;
        END IF;
    ELSE
        -- a new row, unless the key outlived an earlier row of the same id (in the record, or,
        -- in a snapshot older than the retention run that moved it there, still in the outbox)
        SELECT p.event_type, p.subscription_id INTO v_type, v_sub
          FROM ((SELECT k.event_type, k.subscription_id FROM idem_emitted_keys k
                  WHERE k.event_id = v_event_id)
                UNION ALL
                (SELECT o.event_type, o.subscription_id FROM event_outbox o
                  WHERE o.event_id = v_event_id AND o.outbox_id <> v_outbox)
                LIMIT 1) p;
        IF v_type IS NULL THEN
            -- wake a relay only if one waits for it: a NOTIFY makes PostgreSQL commit notifying
            -- transactions one at a time; a busy relay polls
            IF idem.idem_relay_waits() THEN
                PERFORM pg_notify('idem_outbox', '');
            END IF;
            RETURN v_event_id;
        END IF;
        DELETE FROM event_outbox o WHERE o.outbox_id = v_outbox;
    END IF;
    IF v_type IS DISTINCT FROM idem_emit_event.event_type
       OR v_sub IS DISTINCT FROM idem_emit_event.subscription_id THEN
        RAISE EXCEPTION 'idem_emit: dedup key already used for a % event of subscription %',
            v_type, v_sub
            USING ERRCODE = '23505',
                  DETAIL = format('event id %s', v_event_id);
    END IF;
    RETURN v_event_id; -- a replay: the event exists (or existed) already
END
$$;
REVOKE EXECUTE ON FUNCTION idem.idem_emit_event(text, uuid, text, jsonb, jsonb) FROM PUBLIC;
