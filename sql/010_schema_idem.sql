-- Every idem object lives in schema idem (created by `idem migrate`, owned by the migrating
-- role); the bundled billing handlers' tables in schema billing (`idem migrate --billing`).
--
-- A database migrated by an older idem has its objects in the schema that was first on the
-- migrating connection's search_path (usually public), tracked in that schema's
-- idem_schema_migrations. `idem migrate` finds that schema, sets idem.legacy_schema to it and
-- applies this file before any other: the tracking table, the tables (with their indexes,
-- constraints, triggers, row types and identity sequences), the functions and the billing tables
-- move; nothing is copied, every row stays. On a new database idem.legacy_schema is unset and
-- only the hardening below runs.
--
-- Hardening, for both: no role but idem's owner may create objects in schema idem; every idem
-- function pins search_path = pg_catalog, idem, pg_temp (a planted public.format or operator
-- cannot run inside one, least of all inside the SECURITY DEFINER idem_emit); PUBLIC executes no
-- idem function; each of idem's roles gets USAGE on schema idem and may read which migrations
-- are applied (every command checks that at start).
DO $$
DECLARE
    l text := NULLIF(pg_catalog.current_setting('idem.legacy_schema', true), '');
    t text;
    f record;
    moved_billing boolean := false;
BEGIN
    IF l IS NOT NULL AND l <> 'idem' THEN
        FOREACH t IN ARRAY ARRAY['idem_schema_migrations', 'consumed_events', 'event_outbox',
                                 'idem_emitted_keys', 'idem_claim_guard',
                                 'idem_partition_routes', 'idem_partition_fences'] LOOP
            IF pg_catalog.to_regclass(pg_catalog.format('%I.%I', l, t)) IS NOT NULL
               AND pg_catalog.to_regclass(pg_catalog.format('idem.%I', t)) IS NULL THEN
                EXECUTE pg_catalog.format('ALTER TABLE %I.%I SET SCHEMA idem', l, t);
            END IF;
        END LOOP;
        FOR f IN SELECT p.oid::regprocedure AS sig, p.proname
                   FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace = pg_catalog.to_regnamespace(l)
                    AND p.proname IN ('idem_emit', 'idem_claim_check', 'idem_claim_guard_check',
                                      'idem_claim_commit', 'idem_stale_before') LOOP
            EXECUTE pg_catalog.format('ALTER FUNCTION %s SET SCHEMA idem', f.sig);
        END LOOP;
        FOREACH t IN ARRAY ARRAY['dunning', 'revenue_entries', 'receipts'] LOOP
            IF pg_catalog.to_regclass(pg_catalog.format('%I.%I', l, t)) IS NOT NULL THEN
                CREATE SCHEMA IF NOT EXISTS billing;
                REVOKE CREATE ON SCHEMA billing FROM PUBLIC;
                EXECUTE pg_catalog.format('ALTER TABLE %I.%I SET SCHEMA billing', l, t);
                moved_billing := true;
            END IF;
        END LOOP;
        IF moved_billing THEN
            -- what sql/billing/001_billing.sql would have made: it is recorded as applied
            INSERT INTO idem.idem_schema_migrations (version) VALUES ('billing/001_billing.sql')
            ON CONFLICT DO NOTHING;
            IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
                GRANT USAGE ON SCHEMA billing TO idem_consumer;
                IF pg_catalog.to_regclass('billing.dunning') IS NOT NULL THEN
                    GRANT SELECT, INSERT, UPDATE ON billing.dunning TO idem_consumer;
                END IF;
                IF pg_catalog.to_regclass('billing.revenue_entries') IS NOT NULL THEN
                    GRANT INSERT ON billing.revenue_entries TO idem_consumer;
                END IF;
                IF pg_catalog.to_regclass('billing.receipts') IS NOT NULL THEN
                    GRANT INSERT ON billing.receipts TO idem_consumer;
                END IF;
            END IF;
        END IF;
    END IF;

    REVOKE ALL ON SCHEMA idem FROM PUBLIC;
    REVOKE ALL ON TABLE idem.idem_schema_migrations FROM PUBLIC;
    FOR f IN SELECT p.oid::regprocedure AS sig
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'idem'::regnamespace LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET search_path = pg_catalog, idem, pg_temp',
                                  f.sig);
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f.sig);
    END LOOP;
    -- and so for functions later migrations create
    ALTER DEFAULT PRIVILEGES IN SCHEMA idem REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

    IF pg_catalog.to_regprocedure('idem.idem_emit(text, uuid, text, jsonb, jsonb)') IS NOT NULL THEN
        ALTER FUNCTION idem.idem_emit(text, uuid, text, jsonb, jsonb) SECURITY DEFINER;
    END IF;
    FOREACH t IN ARRAY ARRAY['idem_emitter', 'idem_relay', 'idem_consumer', 'idem_operator'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = t) THEN
            EXECUTE pg_catalog.format('GRANT USAGE ON SCHEMA idem TO %I', t);
            EXECUTE pg_catalog.format('GRANT SELECT ON idem.idem_schema_migrations TO %I', t);
        END IF;
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer')
       AND pg_catalog.to_regprocedure('idem.idem_claim_check(bigint, integer)') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION idem.idem_claim_check(bigint, integer) TO idem_consumer;
    END IF;
END
$$;
