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

CREATE TRIGGER chaos_fault BEFORE INSERT OR UPDATE ON dunning
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();
CREATE TRIGGER chaos_fault BEFORE INSERT OR UPDATE ON revenue_entries
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();
CREATE TRIGGER chaos_fault BEFORE INSERT OR UPDATE ON receipts
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();
CREATE TRIGGER chaos_fault BEFORE UPDATE ON event_outbox
    FOR EACH ROW EXECUTE FUNCTION chaos.fail_if_switched_on();

-- The order in which events were applied: every ledger row that commits, with the transaction
-- that claimed it and a global insert number. AFTER ROW triggers run at the end of the claim
-- statement, so a claim that had to wait for another transaction's claim is numbered after it.
CREATE TABLE chaos.applied (
    n        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer text   NOT NULL,
    event_id uuid   NOT NULL,
    xid      xid8   NOT NULL DEFAULT pg_current_xact_id()
);

CREATE FUNCTION chaos.log_applied() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.applied (consumer, event_id) VALUES (NEW.consumer, NEW.event_id);
    RETURN NULL;
END
$$;

CREATE TRIGGER chaos_applied AFTER INSERT ON consumed_events
    FOR EACH ROW EXECUTE FUNCTION chaos.log_applied();
