-- The consumer's transaction can only be committed by the consumer runtime, durably, with the
-- settings it relies on; and one stale rule for the consumer and `idem replay`.
--
-- idem_claim_guard: the runtime's first statement of every claim's transaction upserts the row of
-- its server connection (pg_backend_pid()); the deferred constraint trigger below then runs at
-- that transaction's COMMIT and refuses it (SQLSTATE 2D000) unless idem_claim_commit() ran just
-- before in the same transaction. A handler that runs COMMIT itself (on the connection from
-- idem_event_conn, or through idem_event_exec) therefore commits nothing: the whole transaction
-- rolls back and the runtime dead-letters the event as handler_rejected. Unlogged: the rows are
-- only a hook for the trigger and carry nothing worth keeping across a crash.
CREATE UNLOGGED TABLE IF NOT EXISTS idem.idem_claim_guard (
    pid integer PRIMARY KEY,
    uses bigint NOT NULL DEFAULT 0
);

CREATE OR REPLACE FUNCTION idem.idem_claim_guard_check()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
BEGIN
    IF pg_catalog.current_setting('idem.commit', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'idem: a handler may not end the claim''s transaction (COMMIT refused: '
                        'nothing of it committed)'
            USING ERRCODE = '2D000';
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS idem_claim_guard_commit ON idem.idem_claim_guard;
CREATE CONSTRAINT TRIGGER idem_claim_guard_commit
    AFTER INSERT OR UPDATE ON idem.idem_claim_guard
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION idem.idem_claim_guard_check();

-- Queued by the runtime right before its COMMIT. Fails with SQLSTATE IDEM2 (the handler is at
-- fault: the runtime dead-letters it as handler_rejected) when the transaction is not the one the
-- claim began (a handler ran ROLLBACK and began another) or when a handler changed a setting the
-- runtime relies on: synchronous_commit (the ack follows a durable COMMIT), search_path (the
-- runtime's statements must find idem's tables next time), session_replication_role (replica
-- mode would skip this guard and the handlers' own constraints). Otherwise it allows the COMMIT.
-- caller_search_path: the caller's current_setting('search_path') (inside, the pinned one shows).
CREATE OR REPLACE FUNCTION idem.idem_claim_commit(caller_search_path text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v text;
BEGIN
    IF pg_catalog.current_setting('idem.claim', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'idem: a handler ended the claim''s transaction (ROLLBACK or COMMIT) '
                        'and began another one'
            USING ERRCODE = 'IDEM2';
    END IF;
    v := pg_catalog.current_setting('synchronous_commit');
    IF v NOT IN ('on', 'remote_apply') THEN
        RAISE EXCEPTION 'idem: a handler set synchronous_commit to %: the consumer''s commits '
                        'must stay durable', v
            USING ERRCODE = 'IDEM2';
    END IF;
    IF caller_search_path IS DISTINCT FROM pg_catalog.current_setting('idem.search_path', true)
    THEN
        RAISE EXCEPTION 'idem: a handler changed search_path to %', caller_search_path
            USING ERRCODE = 'IDEM2';
    END IF;
    v := pg_catalog.current_setting('session_replication_role');
    IF v <> 'origin' THEN
        RAISE EXCEPTION 'idem: a handler set session_replication_role to %', v
            USING ERRCODE = 'IDEM2';
    END IF;
    PERFORM pg_catalog.set_config('idem.commit', 'on', true);
END
$$;

-- The one stale rule (contract, "Failure policy (consumer)"): an event whose timestamp, in whole
-- seconds rounded down, lies before this second is stale for a dedup window of window_ms, by the
-- database's clock. The consumer's claim and `idem replay` both use it, so a row replay accepts
-- is fresh for a consumer with the same window (until it ages past the window itself). `retain`
-- keeps ledger rows one day longer than the window: a delivery accepted as
-- fresh, with a timestamp up to one day in the future, still finds its ledger row.
CREATE OR REPLACE FUNCTION idem.idem_stale_before(window_ms bigint)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, idem, pg_temp
AS $$
    SELECT pg_catalog.int8(pg_catalog.floor(pg_catalog.date_part('epoch', pg_catalog.now())))
           OPERATOR(pg_catalog.-) (window_ms OPERATOR(pg_catalog./) 1000)
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
        GRANT SELECT, INSERT, UPDATE ON idem.idem_claim_guard TO idem_consumer;
        GRANT EXECUTE ON FUNCTION idem.idem_claim_commit(text) TO idem_consumer;
        GRANT EXECUTE ON FUNCTION idem.idem_stale_before(bigint) TO idem_consumer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_operator') THEN
        GRANT EXECUTE ON FUNCTION idem.idem_stale_before(bigint) TO idem_operator;
    END IF;
END
$$;
