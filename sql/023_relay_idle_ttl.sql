-- A relay's idle row counts for 30 seconds after the relay last wrote it, and an idle relay
-- writes it again every 10 seconds (relay_wake.c). 021 names the row's session by pid and
-- application_name; where every session of a database has one application_name (a conninfo or
-- PGAPPNAME that sets it), a row left by a relay killed while idle counted again once PostgreSQL
-- gave its pid to another session, and every emit notified, and so committed one at a time,
-- until that session ended. Now such a row counts for at most 30 seconds. A relay idle for
-- longer is still notified: its row is never older than about 10 seconds. A live relay whose
-- row is late (a stalled host) is found by its own polls, within its poll interval, as after
-- any missed wake-up.
CREATE OR REPLACE FUNCTION idem.idem_relay_waits()
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
BEGIN
    -- a row whose session is gone (a relay killed while idle), or whose pid another session has
    -- since (021), or that its relay has not written for 30 seconds, wakes nobody
    RETURN EXISTS (SELECT 1 FROM idem_relay_idle i
                    WHERE i.since > now() - interval '30 seconds'
                      AND EXISTS (SELECT 1 FROM pg_stat_get_activity(i.pid) a
                                   WHERE a.pid = i.pid AND a.application_name = i.app));
END
$$;
REVOKE EXECUTE ON FUNCTION idem.idem_relay_waits() FROM PUBLIC;

-- the relay writes its row again with INSERT ... ON CONFLICT (pid) DO UPDATE
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_relay') THEN
        GRANT UPDATE (since, app) ON idem.idem_relay_idle TO idem_relay;
    END IF;
END
$$;
