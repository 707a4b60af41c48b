-- Partitioned consumer groups (--partitions P > 1): where each subscription's events came from,
-- and the fences that let a subscription move from one partition to another in order.
--
-- RabbitMQ's consistent-hash exchange can map a subscription to another partition after the
-- broker restarts (3.10 rebuilds its hash ring from the bindings in the order they are recovered,
-- which varies). Events of that subscription published before the restart wait in the old
-- partition, later ones arrive in the new one. The consumer that meets a subscription in a new
-- partition holds its events there, publishes a fence into the old partition (behind every
-- earlier event of the subscription, since the queue is FIFO), and goes on once a consumer of the
-- old partition has reached the fence and recorded it here.

-- The partition each subscription's events were last applied from, per consumer group.
CREATE TABLE idem.idem_partition_routes (
    consumer        text NOT NULL,
    subscription_id uuid NOT NULL,
    partition       integer NOT NULL CHECK (partition >= 0),
    moved_at        timestamptz,
    PRIMARY KEY (consumer, subscription_id)
);

-- Fences reached in their partition, until the consumer waiting for one takes it.
CREATE TABLE idem.idem_partition_fences (
    consumer   text NOT NULL,
    fence_id   uuid NOT NULL,
    reached_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, fence_id)
);

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_consumer') THEN
        GRANT SELECT, INSERT, UPDATE ON idem.idem_partition_routes TO idem_consumer;
        GRANT SELECT, INSERT, DELETE ON idem.idem_partition_fences TO idem_consumer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'idem_operator') THEN
        GRANT SELECT ON idem.idem_partition_routes, idem.idem_partition_fences TO idem_operator;
    END IF;
END
$$;
