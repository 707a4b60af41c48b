-- Narrower rights for consumers and operators.
--
-- A consumer writes only its own ledger rows. Each consumer name belongs to one role
-- (idem_consumer_roles): the consumer binds its name to its login role (session_user) when it
-- starts (idem_consumer_bind), unless the name is bound already, and a row-level security policy
-- lets a role insert ledger rows only under the names bound to a role it is a member of. So a
-- consumer (or a handler running in its transaction) cannot pre-claim event ids under another
-- consumer's name. idem's owner can bind names ahead (INSERT INTO idem.idem_consumer_roles) and
-- rebind them (UPDATE ... SET role), e.g. to a group role that several login roles share; a
-- binding whose role was dropped frees the name. The check is one subquery (an InitPlan) per claim
-- statement, not one per row (the role is kept as its oid, regrole: no catalog join).
--
-- Operators change rows only through functions that enforce the rules: idem_replay returns
-- failed rows to pending, none older than the dedup window given (then it changes nothing);
-- idem_retain_* delete sent outbox rows, ledger rows at least a day old and emitted keys, in
-- bounded batches. idem_operator keeps SELECT and loses UPDATE and DELETE on idem's tables, so it
-- can no longer mark a pending row sent, delete a pending or failed row, or rewrite the ledger.
CREATE TABLE IF NOT EXISTS idem.idem_consumer_roles (
    consumer text PRIMARY KEY,
    role regrole NOT NULL,
    bound_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);

-- Binds consumer to the caller's login role unless it is bound already; refuses (42501) a caller
-- that is not a member of the role the name is bound to. Returns that role.
CREATE OR REPLACE FUNCTION idem.idem_consumer_bind(consumer text)
RETURNS regrole
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_role regrole;
BEGIN
    IF consumer IS NULL OR consumer = '' THEN
        RAISE EXCEPTION 'idem_consumer_bind: the consumer name must not be empty'
            USING ERRCODE = '22023';
    END IF;
    DELETE FROM idem.idem_consumer_roles b
     WHERE b.consumer = idem_consumer_bind.consumer
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid = b.role::oid);
    INSERT INTO idem.idem_consumer_roles (consumer, role)
    SELECT idem_consumer_bind.consumer, r.oid::regrole FROM pg_catalog.pg_roles r
     WHERE r.rolname = session_user
    ON CONFLICT ON CONSTRAINT idem_consumer_roles_pkey DO NOTHING;
    SELECT b.role INTO v_role FROM idem.idem_consumer_roles b
     WHERE b.consumer = idem_consumer_bind.consumer;
    -- current_user: idem's owner (this function's), who may write any row anyway
    IF NOT pg_catalog.pg_has_role(session_user, v_role::oid, 'MEMBER')
       AND NOT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        RAISE EXCEPTION 'consumer name "%" belongs to role %, not to %', consumer, v_role,
            session_user
            USING ERRCODE = '42501',
                  HINT = 'idem''s owner can rebind it (UPDATE idem.idem_consumer_roles)';
    END IF;
    RETURN v_role;
END
$$;

ALTER TABLE idem.consumed_events ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS idem_ledger_read ON idem.consumed_events;
CREATE POLICY idem_ledger_read ON idem.consumed_events FOR SELECT USING (true);
DROP POLICY IF EXISTS idem_ledger_own_rows ON idem.consumed_events;
CREATE POLICY idem_ledger_own_rows ON idem.consumed_events FOR INSERT
    WITH CHECK (consumer OPERATOR(pg_catalog.=) ANY (ARRAY(
        SELECT b.consumer FROM idem.idem_consumer_roles b
         WHERE pg_catalog.pg_has_role(session_user, b.role::oid, 'MEMBER'))));

-- Returns failed rows to pending (attempts 0, next attempt now, last_error kept): the one of
-- event_id, or every failed row when it is NULL. If any of them is older than the dedup window
-- window_ms by the consumers' stale rule (idem_stale_before, on created_at in whole seconds),
-- nothing changes. One row per failed row concerned: whether it is stale, its created_at
-- (RFC 3339 UTC), and whether it was replayed. Relays are woken at COMMIT.
CREATE OR REPLACE FUNCTION idem.idem_replay(event_id uuid, window_ms bigint)
RETURNS TABLE (stale boolean, created text, replayed boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
DECLARE
    v_cut bigint;
    v_ids uuid[];
    v_stale bigint;
BEGIN
    IF window_ms IS NULL OR window_ms < 0 THEN
        RAISE EXCEPTION 'idem_replay: the dedup window must not be negative'
            USING ERRCODE = '22023';
    END IF;
    v_cut := idem.idem_stale_before(window_ms);
    -- locked first: no row changes between the check and the update
    IF idem_replay.event_id IS NULL THEN
        v_ids := ARRAY(SELECT o.event_id FROM idem.event_outbox o WHERE o.status = 'failed'
                        ORDER BY o.outbox_id FOR UPDATE);
    ELSE
        v_ids := ARRAY(SELECT o.event_id FROM idem.event_outbox o
                        WHERE o.status = 'failed' AND o.event_id = idem_replay.event_id
                          FOR UPDATE);
    END IF;
    SELECT count(*) INTO v_stale FROM idem.event_outbox o
     WHERE o.event_id = ANY (v_ids)
       AND pg_catalog.floor(pg_catalog.date_part('epoch', o.created_at))::bigint < v_cut;
    IF v_stale > 0 THEN
        RETURN QUERY
            SELECT pg_catalog.floor(pg_catalog.date_part('epoch', o.created_at))::bigint < v_cut,
                   pg_catalog.to_char(o.created_at AT TIME ZONE 'UTC',
                                      'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                   false
              FROM idem.event_outbox o WHERE o.event_id = ANY (v_ids);
        RETURN;
    END IF;
    RETURN QUERY
        UPDATE idem.event_outbox o
           SET status = 'pending', attempts = 0, next_attempt_at = pg_catalog.now()
         WHERE o.event_id = ANY (v_ids) AND o.status = 'failed'
        RETURNING false, pg_catalog.to_char(o.created_at AT TIME ZONE 'UTC',
                                            'YYYY-MM-DD"T"HH24:MI:SS"Z"'), true;
    IF FOUND THEN
        PERFORM pg_catalog.pg_notify('idem_outbox', '');
    END IF;
END
$$;

-- Retention, one bounded batch each (FOR UPDATE SKIP LOCKED: rows another transaction holds
-- wait for the next run); each returns how many rows it deleted. Only sent outbox rows, by
-- sent_at; ledger rows by consumed_at and never younger than a day (a consumer takes timestamps
-- up to a day ahead as they are, so a younger row may still be what stops a redelivery);
-- emitted keys by first_emitted_at. A cutoff in the future counts as now.
CREATE OR REPLACE FUNCTION idem.idem_retain_outbox(cutoff timestamptz, batch integer)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
    -- each sent row is replaced by its key in the record of emitted keys, in the same statement
    -- (sql/018_emitted_keys_at_retention.sql: idem_emit writes the key nowhere else)
    WITH d AS (
        DELETE FROM idem.event_outbox WHERE status = 'sent' AND outbox_id IN (
            SELECT outbox_id FROM idem.event_outbox
             WHERE status = 'sent' AND sent_at < LEAST(cutoff, pg_catalog.now())
             ORDER BY sent_at LIMIT GREATEST(batch, 0) FOR UPDATE SKIP LOCKED)
        RETURNING event_id, event_type, subscription_id, created_at),
    k AS (
        INSERT INTO idem.idem_emitted_keys (event_id, event_type, subscription_id, first_emitted_at)
        SELECT event_id, event_type, subscription_id, created_at FROM d
        ON CONFLICT (event_id) DO NOTHING)
    SELECT pg_catalog.count(*) FROM d
$$;

CREATE OR REPLACE FUNCTION idem.idem_retain_ledger(cutoff timestamptz, batch integer)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
    -- ctid: a TID scan over exactly the rows the subquery locked, no second index lookup
    WITH d AS (
        DELETE FROM idem.consumed_events WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM idem.consumed_events
             WHERE consumed_at < LEAST(cutoff, pg_catalog.now() - interval '1 day')
             ORDER BY consumed_at LIMIT GREATEST(batch, 0) FOR UPDATE SKIP LOCKED))
        RETURNING 1)
    SELECT pg_catalog.count(*) FROM d
$$;

CREATE OR REPLACE FUNCTION idem.idem_retain_keys(cutoff timestamptz, batch integer)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, idem, pg_temp
AS $$
    WITH d AS (
        DELETE FROM idem.idem_emitted_keys WHERE event_id IN (
            SELECT event_id FROM idem.idem_emitted_keys
             WHERE first_emitted_at < LEAST(cutoff, pg_catalog.now())
             ORDER BY first_emitted_at LIMIT GREATEST(batch, 0) FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT pg_catalog.count(*) FROM d
$$;

REVOKE ALL ON TABLE idem.idem_consumer_roles FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idem.idem_consumer_bind(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idem.idem_replay(uuid, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idem.idem_retain_outbox(timestamptz, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idem.idem_retain_ledger(timestamptz, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idem.idem_retain_keys(timestamptz, integer) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
        -- the policy's subquery reads the bindings as the inserting role
        GRANT SELECT ON idem.idem_consumer_roles TO idem_consumer;
        GRANT EXECUTE ON FUNCTION idem.idem_consumer_bind(text) TO idem_consumer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_operator') THEN
        REVOKE UPDATE, DELETE ON idem.event_outbox, idem.consumed_events, idem.idem_emitted_keys
            FROM idem_operator;
        -- column privileges are revoked column by column
        REVOKE UPDATE (status, attempts, next_attempt_at) ON idem.event_outbox FROM idem_operator;
        REVOKE UPDATE (consumed_at) ON idem.consumed_events FROM idem_operator;
        REVOKE UPDATE (first_emitted_at) ON idem.idem_emitted_keys FROM idem_operator;
        GRANT SELECT ON idem.idem_consumer_roles TO idem_operator;
        GRANT EXECUTE ON FUNCTION idem.idem_replay(uuid, bigint),
            idem.idem_retain_outbox(timestamptz, integer),
            idem.idem_retain_ledger(timestamptz, integer),
            idem.idem_retain_keys(timestamptz, integer) TO idem_operator;
    END IF;
END
$$;
