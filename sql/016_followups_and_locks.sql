-- Follow-up events, and no lock another role can take.
--
-- Follow-ups: a handler emits an event for the event it applies through idem_emit_followup, in
-- the claim's transaction, with the dedup key idem:<parent event id>:<name>. The key namespace
-- idem: is reserved for them: idem_emit refuses such keys (22023), so an emitter cannot squat the
-- key of a follow-up it does not own (before, invoice.paid's receipt had the documented key
-- <invoice_id>:receipt, and whoever emitted it first decided the receipt, or made the real
-- invoice.paid fail). idem_emit_followup is executable by idem_consumer only, and only for a
-- parent this transaction claimed: its ledger row (consumed_events) was written by the current
-- transaction. Both run the same body, idem_emit_event, which nobody but idem's owner executes.
CREATE FUNCTION idem.idem_emit_event(event_type text, subscription_id uuid, dedup_key text,
                                     payload jsonb, headers jsonb)
RETURNS uuid
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_event_id uuid;
    v_type text;
    v_sub uuid;
    v_name text;
    v_timeout text;
    v_new boolean;
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
    -- caller's transaction; a wait behind another emitter of the subscription is bounded
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
    INSERT INTO idem_emitted_keys (event_id, event_type, subscription_id)
    VALUES (v_event_id, idem_emit_event.event_type, idem_emit_event.subscription_id)
    ON CONFLICT (event_id) DO NOTHING;
    v_new := FOUND;
    IF v_timeout = '0' THEN
        PERFORM set_config('lock_timeout', v_timeout, true);
    END IF;
    IF NOT v_new THEN
        SELECT k.event_type, k.subscription_id INTO v_type, v_sub
          FROM idem_emitted_keys k WHERE k.event_id = v_event_id;
        IF v_type IS DISTINCT FROM idem_emit_event.event_type
           OR v_sub IS DISTINCT FROM idem_emit_event.subscription_id THEN
            RAISE EXCEPTION 'idem_emit: dedup key already used for a % event of subscription %',
                v_type, v_sub
                USING ERRCODE = '23505',
                      DETAIL = format('event id %s', v_event_id);
        END IF;
        RETURN v_event_id; -- a replay: the event exists (or existed) already
    END IF;
    INSERT INTO event_outbox AS o (event_id, subscription_id, event_type, payload, headers)
    VALUES (v_event_id, idem_emit_event.subscription_id, idem_emit_event.event_type,
            idem_emit_event.payload, idem_emit_event.headers)
    ON CONFLICT ON CONSTRAINT event_outbox_event_id_key DO NOTHING;
    -- wake a relay only if one waits for it (src/relay_wake.c): a NOTIFY makes PostgreSQL commit
    -- notifying transactions one at a time; a busy relay polls
    IF FOUND AND EXISTS (SELECT 1 FROM idem_relay_idle) THEN
        PERFORM pg_notify('idem_outbox', '');
    END IF;
    RETURN v_event_id;
END
$$;
REVOKE EXECUTE ON FUNCTION idem.idem_emit_event(text, uuid, text, jsonb, jsonb) FROM PUBLIC;

CREATE OR REPLACE FUNCTION idem.idem_emit(event_type text, subscription_id uuid, dedup_key text,
                                          payload jsonb, headers jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
BEGIN
    IF dedup_key IS NULL OR dedup_key = '' THEN
        RAISE EXCEPTION 'idem_emit: dedup_key must not be empty' USING ERRCODE = '22023';
    END IF;
    IF starts_with(dedup_key, 'idem:') THEN
        RAISE EXCEPTION 'idem_emit: dedup keys starting with "idem:" are reserved for follow-ups '
                        '(idem_emit_followup)' USING ERRCODE = '22023';
    END IF;
    RETURN idem_emit_event(event_type, subscription_id, dedup_key, payload, headers);
END
$$;

CREATE FUNCTION idem.idem_emit_followup(parent_event_id uuid, name text, event_type text,
                                        subscription_id uuid, payload jsonb,
                                        headers jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
BEGIN
    IF parent_event_id IS NULL THEN
        RAISE EXCEPTION 'idem_emit_followup: parent_event_id must not be null'
            USING ERRCODE = '22023';
    END IF;
    IF name IS NULL OR name = '' OR octet_length(name) > 200 THEN
        RAISE EXCEPTION 'idem_emit_followup: name must be 1-200 bytes' USING ERRCODE = '22023';
    END IF;
    -- the parent must be claimed by this transaction: its ledger row is ours (xmin), so a
    -- follow-up cannot be made for an event the caller never received, nor ahead of it
    IF NOT EXISTS (SELECT 1 FROM consumed_events c
                    WHERE c.event_id = parent_event_id
                      AND c.xmin = pg_current_xact_id()::xid) THEN
        RAISE EXCEPTION 'idem_emit_followup: event % is not claimed in this transaction',
            parent_event_id USING ERRCODE = '22023';
    END IF;
    RETURN idem_emit_event(event_type, subscription_id,
                           'idem:' || parent_event_id::text || ':' || name, payload, headers);
END
$$;
REVOKE EXECUTE ON FUNCTION idem.idem_emit_followup(uuid, text, text, uuid, jsonb, jsonb)
    FROM PUBLIC;

-- Single runners without advisory locks (which any role that can connect may take and hold).
-- idem_migrate_lock (made by `idem migrate` before any migration, so that it exists on an empty
-- database too) is locked IN EXCLUSIVE MODE by each migration's transaction; a role without
-- privileges on it can take no lock that conflicts (only ACCESS SHARE, by a function such as
-- pg_relation_size). idem_leases: the row of a single-runner command that works in many short
-- transactions (retain), taken by writing its backend's pid, free again when that backend is gone
-- or the server restarted; only idem's owner and idem_operator may write it.
CREATE TABLE IF NOT EXISTS idem.idem_migrate_lock ();
CREATE TABLE idem.idem_leases (
    name         text        PRIMARY KEY,
    pid          integer,
    server_start timestamptz,
    taken_at     timestamptz
);
INSERT INTO idem.idem_leases (name) VALUES ('retain');
REVOKE ALL ON idem.idem_migrate_lock, idem.idem_leases FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
        GRANT EXECUTE ON FUNCTION idem.idem_emit_followup(uuid, text, text, uuid, jsonb, jsonb)
            TO idem_consumer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_operator') THEN
        GRANT SELECT, UPDATE (pid, server_start, taken_at) ON idem.idem_leases TO idem_operator;
    END IF;
END
$$;
