/* idem/consumer.h - the exactly-once consumer runtime.
 *
 * For each delivery: validate the envelope; in one PostgreSQL transaction claim
 * (consumer, event_id) in consumed_events and run the handler for the event type; COMMIT;
 * ack only after the commit succeeded. Deliveries are taken in batches that share one
 * transaction; a failing event falls back to one transaction per event so it cannot sink its
 * batch-mates. */
#ifndef IDEM_CONSUMER_H
#define IDEM_CONSUMER_H

#include <signal.h>
#include <stdint.h>

#include <idem/error.h>
#include <idem/handler.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_consumer idem_consumer_t;

typedef struct idem_consumer_config {
    const char *consumer;        /* ledger name, required */
    const char *queue;           /* durable quorum queue, required; its DLQ is "<queue>.dlq" */
    const char *pg_conninfo;     /* libpq conninfo or URI; "" = PG* defaults */
    const char *amqp_url;        /* amqp://user:pass@host:port/vhost */
    const char *exchange;        /* durable topic exchange, default "billing.events" */
    const char *const *binds;    /* NULL-terminated routing keys; NULL = registered event types */
    int prefetch;                /* default 200 */
    int batch_max;               /* deliveries per transaction, default 100 */
    int64_t linger_ms;           /* wait for batch-mates after the first delivery, default 2 */
    int64_t dedup_window_ms;     /* older deliveries are dead-lettered as stale; default 30d */
    int64_t max_message_bytes;   /* default 1048576 */
    int max_retries;             /* tries = max_retries + 1; default 5 */
    int metrics_port;            /* 0 = no metrics endpoint */
    volatile sig_atomic_t *stop; /* optional: the loop finishes its batch and returns when *stop */
} idem_consumer_config_t;

/* Fills cfg with the defaults above (strings NULL). */
void idem_consumer_config_init(idem_consumer_config_t *cfg);

/* Returns a new consumer (free with idem_consumer_free) or NULL with err set. cfg's strings
 * are copied. Does not connect. */
idem_consumer_t *idem_consumer_new(const idem_consumer_config_t *cfg, idem_error_t *err);

/* Registers fn for event_type (copied). A second registration for a type replaces the first.
 * 0 or IDEM_ERR_INVALID / IDEM_ERR_NOMEM. */
int idem_consumer_register(idem_consumer_t *c, const char *event_type, idem_handler_fn fn,
                           void *userdata);

/* Runs until *cfg.stop is set (returns 0 after finishing, committing and acking the batch in
 * hand) or a configuration error makes running pointless (negative status, err set).
 * Unreachable servers are retried with backoff, never returned as errors. */
int idem_consumer_run(idem_consumer_t *c, idem_error_t *err);

void idem_consumer_free(idem_consumer_t *c); /* NULL is a no-op */

#ifdef __cplusplus
}
#endif
#endif
