-- The consumer's one-round-trip batch: it queues the claim of a batch's event ids, the handlers'
-- statements and COMMIT together, before it knows what the claim found. The claim ends with this
-- check, so that a batch holding an id that is not new (a redelivery, a duplicate, a stale
-- event) fails as a whole at its claim: every later statement of the pipeline, COMMIT included,
-- is then skipped, nothing of the batch commits, and the consumer tries the batch again with its
-- claim read first (only the new ids' handlers run). SQLSTATE IDEM1 tells that failure apart.
CREATE FUNCTION idem.idem_claim_check(claimed bigint, wanted integer)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, idem, pg_temp
AS $$
BEGIN
    IF claimed IS DISTINCT FROM wanted THEN
        RAISE EXCEPTION 'idem: % of % event ids of the batch are new', claimed, wanted
            USING ERRCODE = 'IDEM1';
    END IF;
    RETURN claimed;
END
$$;

REVOKE EXECUTE ON FUNCTION idem.idem_claim_check(bigint, integer) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
        GRANT EXECUTE ON FUNCTION idem.idem_claim_check(bigint, integer) TO idem_consumer;
    END IF;
END
$$;
