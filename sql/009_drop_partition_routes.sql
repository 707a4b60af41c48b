-- Partitioned groups no longer need routes or fences: the relay sends each event's shard key
-- (idem.shard.N, from its subscription id) and the group binds each shard to one partition, so a
-- subscription's events always reach the same partition, whatever happens to the broker. The
-- tables that let a subscription move between partitions of RabbitMQ's consistent-hash ring go.
-- (Run after the consumers of an older idem are stopped: see the README, "Upgrading and changing
-- --partitions".)
DROP TABLE IF EXISTS idem.idem_partition_fences;
DROP TABLE IF EXISTS idem.idem_partition_routes;
