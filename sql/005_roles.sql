-- Least privilege. Four NOLOGIN roles, each granted exactly what its commands need; a login role
-- that is a member of one can run those commands and nothing more:
--   idem_emitter   idem_emit (your application's role, or emit)
--   idem_relay     relay
--   idem_consumer  consume (the bundled billing handlers' tables: sql/billing/)
--   idem_operator  status, failed, replay, retain
-- The roles are created when the migrating user may (CREATEROLE); otherwise one notice says so
-- and the grants go to the roles that exist. idem_emit runs as its owner (SECURITY DEFINER) with
-- a pinned search_path, so emitters need no table privileges, and PUBLIC cannot execute it.
DO $$
DECLARE
    r text;
    can_create boolean;
BEGIN
    SELECT rolcreaterole OR rolsuper INTO can_create FROM pg_catalog.pg_roles WHERE rolname = current_user;
    FOREACH r IN ARRAY ARRAY['idem_emitter', 'idem_relay', 'idem_consumer', 'idem_operator'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            IF can_create THEN
                EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', r);
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
    has_role text[] := ARRAY(SELECT rolname::text FROM pg_catalog.pg_roles
                             WHERE rolname IN ('idem_emitter', 'idem_relay', 'idem_consumer',
                                               'idem_operator'));
BEGIN
    ALTER FUNCTION idem.idem_emit(text, uuid, text, jsonb, jsonb) SECURITY DEFINER
        SET search_path = pg_catalog, idem, pg_temp;
    REVOKE EXECUTE ON FUNCTION idem.idem_emit(text, uuid, text, jsonb, jsonb) FROM PUBLIC;

    IF 'idem_emitter' = ANY (has_role) THEN
        GRANT USAGE ON SCHEMA idem TO idem_emitter;
        GRANT EXECUTE ON FUNCTION idem.idem_emit(text, uuid, text, jsonb, jsonb) TO idem_emitter;
    END IF;
    IF 'idem_relay' = ANY (has_role) THEN
        GRANT USAGE ON SCHEMA idem TO idem_relay;
        -- the claim locks rows (FOR UPDATE), the marks update them
        GRANT SELECT, UPDATE (status, sent_at, attempts, last_error, next_attempt_at)
            ON idem.event_outbox TO idem_relay;
    END IF;
    IF 'idem_consumer' = ANY (has_role) THEN
        GRANT USAGE ON SCHEMA idem TO idem_consumer;
        GRANT SELECT, INSERT ON idem.consumed_events TO idem_consumer;
        -- follow-up events (invoice.paid emits receipt.requested)
        GRANT EXECUTE ON FUNCTION idem.idem_emit(text, uuid, text, jsonb, jsonb) TO idem_consumer;
        -- the bundled billing handlers' tables: sql/billing/001_billing.sql (migrate --billing)
    END IF;
    IF 'idem_operator' = ANY (has_role) THEN
        GRANT USAGE ON SCHEMA idem TO idem_operator;
        GRANT SELECT, DELETE ON idem.event_outbox, idem.consumed_events, idem.idem_emitted_keys
            TO idem_operator;
        -- replay returns failed rows to pending
        GRANT UPDATE (status, attempts, next_attempt_at) ON idem.event_outbox TO idem_operator;
        -- retention locks the rows it deletes (FOR UPDATE SKIP LOCKED needs UPDATE on a column)
        GRANT UPDATE (consumed_at) ON idem.consumed_events TO idem_operator;
        GRANT UPDATE (first_emitted_at) ON idem.idem_emitted_keys TO idem_operator;
    END IF;
END
$$;
