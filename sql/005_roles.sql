-- Least privilege. Four NOLOGIN roles, each granted exactly what its commands need; a login role
-- that is a member of one can run those commands and nothing more:
--   idem_emitter   idem_emit (your application's role, or emit)
--   idem_relay     relay
--   idem_consumer  consume, with the bundled billing handlers' tables
--   idem_operator  status, failed, replay, retain
-- The roles are created when the migrating user may (CREATEROLE); otherwise one notice says so
-- and the grants go to the roles that exist. idem_emit runs as its owner (SECURITY DEFINER) with
-- a pinned search_path, so emitters need no table privileges, and PUBLIC cannot execute it.
DO $$
DECLARE
    r text;
    can_create boolean;
BEGIN
    SELECT rolcreaterole OR rolsuper INTO can_create FROM pg_roles WHERE rolname = current_user;
    FOREACH r IN ARRAY ARRAY['idem_emitter', 'idem_relay', 'idem_consumer', 'idem_operator'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            IF can_create THEN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            ELSE
                RAISE NOTICE 'idem: role % does not exist and % may not create it; grants to it skipped',
                    r, current_user;
            END IF;
        END IF;
    END LOOP;
END
$$;

DO $$
DECLARE
    s text := quote_ident(current_schema());
    has_role text[] := ARRAY(SELECT rolname::text FROM pg_roles
                             WHERE rolname IN ('idem_emitter', 'idem_relay', 'idem_consumer',
                                               'idem_operator'));
BEGIN
    EXECUTE format('ALTER FUNCTION idem_emit(text, uuid, text, jsonb, jsonb) SECURITY DEFINER '
                   'SET search_path = %s, pg_temp', s);
    REVOKE EXECUTE ON FUNCTION idem_emit(text, uuid, text, jsonb, jsonb) FROM PUBLIC;

    IF 'idem_emitter' = ANY (has_role) THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %s TO idem_emitter', s);
        GRANT EXECUTE ON FUNCTION idem_emit(text, uuid, text, jsonb, jsonb) TO idem_emitter;
    END IF;
    IF 'idem_relay' = ANY (has_role) THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %s TO idem_relay', s);
        -- the claim locks rows (FOR UPDATE), the marks update them
        GRANT SELECT, UPDATE (status, sent_at, attempts, last_error, next_attempt_at)
            ON event_outbox TO idem_relay;
    END IF;
    IF 'idem_consumer' = ANY (has_role) THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %s TO idem_consumer', s);
        GRANT SELECT, INSERT ON consumed_events TO idem_consumer;
        -- follow-up events (invoice.paid emits receipt.requested)
        GRANT EXECUTE ON FUNCTION idem_emit(text, uuid, text, jsonb, jsonb) TO idem_consumer;
        -- the bundled billing handlers
        GRANT SELECT, INSERT, UPDATE ON dunning TO idem_consumer;
        GRANT INSERT ON revenue_entries, receipts TO idem_consumer;
    END IF;
    IF 'idem_operator' = ANY (has_role) THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %s TO idem_operator', s);
        GRANT SELECT, DELETE ON event_outbox, consumed_events, idem_emitted_keys TO idem_operator;
        -- replay returns failed rows to pending
        GRANT UPDATE (status, attempts, next_attempt_at) ON event_outbox TO idem_operator;
        -- retention locks the rows it deletes (FOR UPDATE SKIP LOCKED needs UPDATE on a column)
        GRANT UPDATE (consumed_at) ON consumed_events TO idem_operator;
        GRANT UPDATE (first_emitted_at) ON idem_emitted_keys TO idem_operator;
    END IF;
END
$$;
