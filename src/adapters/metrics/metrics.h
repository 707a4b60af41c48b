/* metrics.h - the process's counters and the Prometheus /metrics endpoint (metrics_http.c).
 * Every function accepts NULL metrics and then does nothing. Counters are atomic: the HTTP
 * server reads them from its own thread. */
#ifndef IDEM_METRICS_H
#define IDEM_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <idem/error.h>

#include "envelope.h"

typedef enum { IDEMP_ROLE_CONSUMER, IDEMP_ROLE_RELAY } idemp_role;

typedef enum {
    IDEMP_M_RELAY_PUBLISHED,
    IDEMP_M_RELAY_PUBLISH_FAILURES,
    IDEMP_M_RELAY_PARKED,
    IDEMP_M_CONSUMER_APPLIED,
    IDEMP_M_CONSUMER_DUPLICATES,
    IDEMP_M_CONSUMER_HANDLER_ERRORS,
    IDEMP_M_COUNT
} idemp_counter;

typedef enum { IDEMP_SERVER_POSTGRES, IDEMP_SERVER_RABBITMQ } idemp_server;

/* How a delivery settled, for idem_consumer_events_total{event_type,outcome}. */
typedef enum {
    IDEMP_OUT_APPLIED,
    IDEMP_OUT_DUPLICATE,
    IDEMP_OUT_DEAD_LETTERED,
    IDEMP_OUT_COUNT
} idemp_outcome;

typedef struct idemp_metrics idemp_metrics_t;

idemp_metrics_t *idemp_metrics_new(idemp_role role);
/* Starts serving GET /metrics on addr (a numeric IPv4 or IPv6 address; NULL = 127.0.0.1) and
 * port; port 0 does nothing. */
int idemp_metrics_serve(idemp_metrics_t *m, const char *addr, int port, idem_error_t *err);
void idemp_metrics_free(idemp_metrics_t *m);

void idemp_metrics_add(idemp_metrics_t *m, idemp_counter c, uint64_t n);
void idemp_metrics_dead_letter(idemp_metrics_t *m, idemp_dl_code code);
/* The event types counted by name (the registered ones, before serving; at most 64): any
 * other type, e.g. a dead-lettered unknown one, counts as "other", so a hostile sender cannot
 * grow the label set. Returns IDEM_OK or IDEM_ERR_NOMEM. */
int idemp_metrics_event_types(idemp_metrics_t *m, const char *const *types, size_t n);
void idemp_metrics_event(idemp_metrics_t *m, const char *event_type, idemp_outcome outcome);
void idemp_metrics_reconnect(idemp_metrics_t *m, idemp_server server);
/* The consumer paused on sqlstate (a 5-character SQLSTATE). */
void idemp_metrics_paused(idemp_metrics_t *m, const char *sqlstate);
void idemp_metrics_batch_duration(idemp_metrics_t *m, double seconds);
void idemp_metrics_oldest_pending(idemp_metrics_t *m, double seconds); /* gauge; <0 = none */
void idemp_metrics_lag(idemp_metrics_t *m, double seconds);            /* consumer's histogram */
/* The process's health, for /healthz and idem_consumer_up: whether it is connected to PostgreSQL
 * and to RabbitMQ, and the SQLSTATE of a pause (NULL or "" when not paused). Until the first
 * call /healthz answers 503 "starting". */
void idemp_metrics_health(idemp_metrics_t *m, bool pg_up, bool amqp_up, const char *paused);
/* The relay's idem_outbox_rows{status} gauge; negative = not known yet (not exposed). */
void idemp_metrics_outbox_rows(idemp_metrics_t *m, int64_t pending, int64_t failed);
/* The health line of a process in that state ("ok\n", "postgres: disconnected\n", ...) into buf;
 * returns 200 when healthy, else 503. */
int idemp_health_line(bool pg_up, bool amqp_up, const char *paused, char *buf, size_t sz);
/* Writes /healthz's one line (with its newline) to buf; 200 when healthy, else 503. */
int idemp_metrics_healthz(idemp_metrics_t *m, char *buf, size_t sz);
uint64_t idemp_metrics_get(const idemp_metrics_t *m, idemp_counter c);

#endif
