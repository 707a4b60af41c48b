/* idem/relay.h - the outbox relay.
 *
 * Claims due pending rows (FOR UPDATE SKIP LOCKED, whole subscriptions at a time so that one
 * subscription's events are published in emit order however many relays run), publishes them
 * with publisher confirms and mandatory, and marks the confirmed ones sent in the transaction
 * that claimed them. A nack or return spends an attempt and schedules the row with exponential
 * backoff; after max_attempts the row is parked as failed; so does a row the broker refuses or
 * the client cannot encode. An unreachable broker spends nothing: the relay backs off as a whole.
 * A failing statement rolls its transaction back and is retried with backoff.
 * Threads: a relay object belongs to the thread calling idem_relay_run; the stop flag may be set
 * from a signal handler or another thread. */
#ifndef IDEM_RELAY_H
#define IDEM_RELAY_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <idem/error.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_relay idem_relay_t;

typedef struct idem_relay_config {
    const char *pg_conninfo;
    const char *amqp_url;       /* amqp[s]://..., or a comma-separated list of a cluster's nodes */
    const char *amqp_password;  /* overrides the URLs' password when set */
    const char *exchange;       /* default "billing.events" */
    int batch;                  /* rows per claim, default 200 */
    int max_attempts;           /* default 8 */
    int64_t backoff_base_ms;    /* default 1 s */
    int64_t backoff_max_ms;     /* default 5 min */
    int64_t poll_interval_ms;   /* backstop when no NOTIFY arrives, default 200 ms */
    int64_t confirm_timeout_ms; /* waiting for broker confirms, default 30 s */
    int64_t lock_timeout_ms;    /* per transaction; default 5000, 0 = none */
    int64_t statement_timeout_ms; /* per transaction; default 30000, 0 = none */
    int heartbeat_s;              /* AMQP heartbeat; -1 (default) = the URL's heartbeat=, else 30 */
    bool no_declare;              /* declare nothing; check that the exchange exists */
    bool once;                    /* drain what is due, then return */
    int metrics_port;             /* 0 = none */
    const char *metrics_addr;     /* listen address of /metrics, default "127.0.0.1" */
    volatile sig_atomic_t *stop;  /* optional stop flag, checked between batches */
    /* Reload (SIGHUP), optional: when *reload is set, the loop clears it, asks reload_password
     * (if set) for the AMQP password (> 0: a new one in buf, used from the next connection on;
     * 0: none configured; < 0: not readable, err says why, and the one in use stays), logs
     * "reloaded" (info) and goes on. Logging is to stderr, so there is no log file to reopen. */
    volatile sig_atomic_t *reload;
    int (*reload_password)(void *userdata, char *buf, size_t size, idem_error_t *err);
    void *reload_userdata;
    bool sd_notify; /* tell systemd ($NOTIFY_SOCKET) when ready, reloading and stopping */
} idem_relay_config_t;

typedef struct idem_relay_stats {
    uint64_t published; /* rows marked sent */
    uint64_t failures;  /* nacks and returns */
    uint64_t parked;    /* rows moved to failed */
    uint64_t batches;
} idem_relay_stats_t;

void idem_relay_config_init(idem_relay_config_t *cfg);
/* A new relay, or NULL with err set (IDEM_ERR_INVALID: a value out of range or a bad URL;
 * IDEM_ERR_NOMEM). Does not connect. */
idem_relay_t *idem_relay_new(const idem_relay_config_t *cfg, idem_error_t *err);
/* Runs until stopped (daemon) or until nothing is due (once). In once mode a server that cannot
 * be reached, or a failed batch, is an error (IDEM_ERR_PG_CONNECT / IDEM_ERR_AMQP_CONNECT /
 * the failure's status); as a daemon it is retried with backoff. IDEM_ERR_NOT_FOUND: with
 * no_declare, the exchange does not exist. IDEM_ERR_IO: the metrics port. */
int idem_relay_run(idem_relay_t *r, idem_error_t *err);
void idem_relay_get_stats(const idem_relay_t *r, idem_relay_stats_t *out);
void idem_relay_free(idem_relay_t *r);

#ifdef __cplusplus
}
#endif
#endif
