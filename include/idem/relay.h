/* idem/relay.h - the outbox relay.
 *
 * Claims due pending rows (FOR UPDATE SKIP LOCKED, whole subscriptions at a time so that one
 * subscription's events are published in emit order however many relays run), publishes them
 * with publisher confirms and mandatory, and marks the confirmed ones sent in the transaction
 * that claimed them. A nack or return spends an attempt and schedules the row with exponential
 * backoff; after max_attempts the row is parked as failed. An unreachable broker spends nothing:
 * the relay backs off as a whole. */
#ifndef IDEM_RELAY_H
#define IDEM_RELAY_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include <idem/error.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_relay idem_relay_t;

typedef struct idem_relay_config {
    const char *pg_conninfo;
    const char *amqp_url;
    const char *exchange;        /* default "billing.events" */
    int batch;                   /* rows per claim, default 200 */
    int max_attempts;            /* default 8 */
    int64_t backoff_base_ms;     /* default 1 s */
    int64_t backoff_max_ms;      /* default 5 min */
    int64_t poll_interval_ms;    /* backstop when no NOTIFY arrives, default 200 ms */
    int64_t confirm_timeout_ms;  /* waiting for broker confirms, default 30 s */
    bool once;                   /* drain what is due, then return */
    int metrics_port;            /* 0 = none */
    volatile sig_atomic_t *stop; /* optional stop flag, checked between batches */
} idem_relay_config_t;

typedef struct idem_relay_stats {
    uint64_t published; /* rows marked sent */
    uint64_t failures;  /* nacks and returns */
    uint64_t parked;    /* rows moved to failed */
    uint64_t batches;
} idem_relay_stats_t;

void idem_relay_config_init(idem_relay_config_t *cfg);
idem_relay_t *idem_relay_new(const idem_relay_config_t *cfg, idem_error_t *err);
/* Runs until stopped (daemon) or until nothing is due (once). In once mode a server that cannot
 * be reached is an error (IDEM_ERR_PG_CONNECT / IDEM_ERR_AMQP_CONNECT); as a daemon it is
 * retried with backoff. */
int idem_relay_run(idem_relay_t *r, idem_error_t *err);
void idem_relay_get_stats(const idem_relay_t *r, idem_relay_stats_t *out);
void idem_relay_free(idem_relay_t *r);

#ifdef __cplusplus
}
#endif
#endif
