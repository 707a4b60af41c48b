-- No index on seq alone: each of the relay's probes (a subscription's first pending row, and the
-- rows after it in seq order) must walk the index on (subscription_id, seq). Planned from
-- statistics taken while next to nothing was pending (after a TRUNCATE, or an ANALYZE between two
-- bursts), the index on seq alone looked as cheap, and a probe read every pending row through it,
-- filtering on the subscription: claims of 100-400 ms with a few thousand rows pending, against
-- 1-2 ms, and a relay that fell further behind with every claim. With the claim's sorts off
-- (relay_claim.c), the index on (subscription_id, seq) is now the only way to a probe's rows in
-- their order.
--
-- What used it besides: the backlog gauge, the age of the oldest pending row. It reads the index
-- below, by the row's creation time (what "oldest" means to an operator).
CREATE INDEX event_outbox_pending_age ON idem.event_outbox (created_at) WHERE status = 'pending';
DROP INDEX idem.event_outbox_pending;
