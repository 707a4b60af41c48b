-- The dedup ledger keeps a digest of what each consumer applied: SHA-256 of the event type, the
-- subscription id and the payload in a canonical form (src/digest.h), computed by the consumer.
-- A delivery whose id is in the ledger with another digest is an id collision (a forged or
-- reused id), dead-lettered as conflict instead of dropped as a duplicate. Rows written before
-- this migration keep a NULL digest and count as duplicates, as before. A nullable column with
-- no default: adding it rewrites nothing, whatever the ledger's size.
ALTER TABLE idem.consumed_events ADD COLUMN IF NOT EXISTS digest bytea;
