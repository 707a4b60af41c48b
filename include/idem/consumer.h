/* idem/consumer.h - the exactly-once consumer runtime.
 *
 * For each delivery: validate the envelope; in one PostgreSQL transaction claim
 * (consumer, event_id) in consumed_events and run the handler for the event type; COMMIT; ack
 * only after the commit succeeded. Deliveries are taken in batches that share one transaction; a
 * failing event falls back to one transaction per event so it cannot sink its batch-mates. Per
 * subscription, events apply in the order the broker delivered them: a delivery waiting for a
 * retry holds the later ones of its subscription. The ledger keeps a digest of each event's content
 * (type, subscription, payload): a delivery whose id is in it with another content is dead-lettered
 * as conflict, never dropped as a duplicate.
 * Threads: a consumer object belongs to one thread (the one calling idem_consumer_run); handlers
 * run on it. The stop flag may be set from a signal handler or another thread. */
#ifndef IDEM_CONSUMER_H
#define IDEM_CONSUMER_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <idem/error.h>
#include <idem/handler.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_consumer idem_consumer_t;

#define IDEM_PARTITIONS_MAX 1024

typedef struct idem_consumer_config {
    const char *consumer;      /* ledger name, required */
    const char *queue;         /* durable quorum queue, required; its DLQ is "<queue>.dlq" */
    const char *pg_conninfo;   /* libpq conninfo or URI; "" = PG* defaults */
    const char *amqp_url;      /* amqp[s]://user:pass@host:port/vhost, or a comma-separated list */
    const char *amqp_password; /* overrides the URLs' password when set (from a password file) */
    const char *exchange;      /* durable topic exchange, default "billing.events" */
    const char *const *binds;  /* NULL-terminated routing keys; NULL = registered event types */
    int prefetch;              /* unacked deliveries per queue, default 200 */
    int batch_max;             /* deliveries per transaction, default 100 */
    int64_t linger_ms;         /* wait for batch-mates after the first delivery, default 1 */
    int64_t dedup_window_ms;   /* older deliveries are dead-lettered as stale; default 30d */
    int64_t max_message_bytes; /* larger bodies are dead-lettered as oversized; default 1048576 */
    int max_retries;           /* tries = max_retries + 1; default 5 */
    int heartbeat_s;           /* AMQP heartbeat; -1 (default) = the URL's heartbeat=, else 30 */
    int partitions; /* P > 1: a partitioned group (QUEUE.p0 .. QUEUE.p<P-1>); default 1 */
    const int *partition_list; /* the partitions this process consumes; NULL = all */
    int npartition_list;
    int64_t lock_timeout_ms;      /* per transaction; default 5000, 0 = none */
    int64_t statement_timeout_ms; /* per transaction; default 30000, 0 = none */
    bool no_declare;              /* declare nothing; check that what is used exists */
    int metrics_port;             /* 0 = no metrics endpoint */
    const char *metrics_addr;     /* listen address of /metrics, default "127.0.0.1" */
    volatile sig_atomic_t *stop;  /* optional: the loop finishes its batch and returns when *stop */
    /* Reload (SIGHUP), optional: when *reload is set, the loop clears it, asks reload_password
     * (if set) for the AMQP password (> 0: a new one in buf, used from the next connection on;
     * 0: none configured; < 0: not readable, err says why, and the one in use stays), logs
     * "reloaded" (info) and goes on. Logging is to stderr, so there is no log file to reopen. */
    volatile sig_atomic_t *reload;
    int (*reload_password)(void *userdata, char *buf, size_t size, idem_error_t *err);
    void *reload_userdata;
    bool sd_notify; /* tell systemd ($NOTIFY_SOCKET) when ready, reloading and stopping */
    /* NULL-terminated RabbitMQ user names; NULL (default) or empty = any publisher. With one or
     * more, a delivery whose user_id property is absent or not one of them is dead-lettered as
     * untrusted before any claim (RabbitMQ checks user_id against the publisher's login). Owned by
     * the caller: idem_consumer_new copies the list and its strings. */
    const char *const *trusted_publishers;
} idem_consumer_config_t;

/* Fills cfg with the defaults above (strings NULL). */
void idem_consumer_config_init(idem_consumer_config_t *cfg);

/* Returns a new consumer (free with idem_consumer_free) or NULL with err set: IDEM_ERR_INVALID
 * for a missing name or queue, a bad URL, an empty trusted publisher name or a value out of
 * range; IDEM_ERR_NOMEM. cfg's strings and lists are copied (cfg may go once this returns). Does
 * not connect. */
idem_consumer_t *idem_consumer_new(const idem_consumer_config_t *cfg, idem_error_t *err);

/* The handlers registered need migration version (e.g. "billing/001_billing.sql", copied)
 * applied too: at start the consumer checks that idem.idem_schema_migrations records it (and the
 * migrations the runtime itself needs), or ends with one line naming `idem migrate` (with
 * --billing for a billing/ one). 0, IDEM_ERR_INVALID or IDEM_ERR_NOMEM. */
int idem_consumer_require_migration(idem_consumer_t *c, const char *version);

/* Registers fn for event_type (copied). A second registration for a type replaces the first.
 * 0 or IDEM_ERR_INVALID / IDEM_ERR_NOMEM. */
int idem_consumer_register(idem_consumer_t *c, const char *event_type, idem_handler_fn fn,
                           void *userdata);

/* Registers the SQL function "schema.function" (copied) as the handler of event_type: it is
 * called as SELECT schema.function(event_id uuid, event_type text, subscription_id uuid,
 * payload jsonb, headers jsonb) in the claim's transaction; its errors follow the failure policy.
 * idem_consumer_run checks at start that the function exists. 0, IDEM_ERR_INVALID or
 * IDEM_ERR_NOMEM. */
int idem_consumer_register_sql(idem_consumer_t *c, const char *event_type, const char *function);

/* Runs until *cfg.stop is set (returns 0 after finishing, committing and acking the batch in
 * hand) or a configuration error makes running pointless (a negative status with err set:
 * IDEM_ERR_INVALID no handlers; IDEM_ERR_NOT_FOUND a SQL handler function, or with no_declare a
 * queue or exchange, does not exist; IDEM_ERR_REFUSED the RabbitMQ consistent-hash plugin is
 * missing or the group is declared with another partition count; IDEM_ERR_IO the metrics port).
 * Unreachable servers are retried with backoff, never returned as errors. */
int idem_consumer_run(idem_consumer_t *c, idem_error_t *err);

void idem_consumer_free(idem_consumer_t *c); /* NULL is a no-op */

#ifdef __cplusplus
}
#endif
#endif
