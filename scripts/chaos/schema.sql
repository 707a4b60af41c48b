-- The chaos run's own objects (schema chaos), added after `idem migrate` and the demo's business
-- schema (scripts/demo/schema.sql). Nothing here is part of idem.

CREATE SCHEMA chaos;

-- A switch that makes idem's writes fail with a chosen SQLSTATE while it is set (the faults
-- sqlstate-25006 and sqlstate-53100): the bundled handlers' tables, and the relay's updates of
-- the outbox. Emitting (INSERT into event_outbox) and claiming are left alone.
CREATE TABLE chaos.fault (
    single   bool PRIMARY KEY DEFAULT true CHECK (single),
    sqlstate text CHECK (sqlstate ~ '^[0-9A-Z]{5}$')
);
INSERT INTO chaos.fault DEFAULT VALUES;

-- Writes refused so far. A sequence, because it is not rolled back with the refused write.
CREATE SEQUENCE chaos.refused;

CREATE FUNCTION chaos.fail_if_switched_on() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    code text;
BEGIN
    SELECT sqlstate INTO code FROM chaos.fault;
    IF code IS NOT NULL THEN
        PERFORM nextval('chaos.refused');
        RAISE EXCEPTION 'chaos: % on % refused (injected SQLSTATE %)', TG_OP, TG_TABLE_NAME, code
            USING ERRCODE = code;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER chaos_fault BEFORE INSERT OR UPDATE ON billing.dunning
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();
CREATE TRIGGER chaos_fault BEFORE INSERT OR UPDATE ON billing.revenue_entries
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();
CREATE TRIGGER chaos_fault BEFORE INSERT OR UPDATE ON billing.receipts
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();
CREATE TRIGGER chaos_fault BEFORE UPDATE ON idem.event_outbox
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();


-- The order in which the handlers' effects were made, per subscription: every dunning change
-- (with the event that made it) and every revenue entry, numbered as they happen. A dunning row
-- is locked by each change, so for one subscription these numbers are the real order of effects,
-- whichever processes made them.
CREATE TABLE chaos.effects (
    n               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription_id uuid NOT NULL,
    event_id        uuid,
    kind            text NOT NULL,
    app             text DEFAULT current_setting('application_name'),
    xid             xid8 DEFAULT pg_current_xact_id()
);

CREATE FUNCTION chaos.log_effect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'dunning' THEN
        INSERT INTO chaos.effects (subscription_id, event_id, kind)
        VALUES (NEW.subscription_id, NEW.last_event_id, 'dunning');
    ELSE
        INSERT INTO chaos.effects (subscription_id, event_id, kind)
        VALUES (NEW.subscription_id, NEW.event_id, 'revenue');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER chaos_effect_dunning AFTER INSERT OR UPDATE ON billing.dunning
    FOR EACH ROW EXECUTE FUNCTION chaos.log_effect();
CREATE TRIGGER chaos_effect_revenue AFTER INSERT ON billing.revenue_entries
    FOR EACH ROW EXECUTE FUNCTION chaos.log_effect();
