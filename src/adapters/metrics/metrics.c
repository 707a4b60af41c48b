/* metrics.c - the process's counters and the Prometheus /metrics endpoint (metrics_http.c).
 *
 * Writers (the consumer or relay loop) touch only C11 atomics; the HTTP thread reads them and
 * renders text format 0.0.4 on each scrape. Nothing is locked. */
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <idem/idem.h>

#include "metrics.h"
#include "metrics_http.h"

/* Upper bounds of idem_batch_duration_seconds, 1 ms to 10 s (+Inf is implicit). */
static const double bucket_le[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25,  0.5,    1.0,   2.5,  5.0,   10.0};
#define NBUCKETS (sizeof bucket_le / sizeof bucket_le[0])
#define PAUSED_MAX 64 /* distinct SQLSTATEs; later ones count under the last slot's "other" */
#define TYPES_MAX 64  /* event types counted by name; the rest count as "other" */

/* Upper bounds of idem_consumer_lag_seconds, 0.5 ms to 5 min. */
static const double lag_le[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                0.5,    1.0,   2.5,    5.0,   10.0, 30.0,  60.0, 300.0};
#define NLAG (sizeof lag_le / sizeof lag_le[0])

struct idemp_metrics {
    idemp_role role;
    _Atomic uint64_t counters[IDEMP_M_COUNT];
    _Atomic uint64_t dead_letters[IDEMP_DL_COUNT];
    _Atomic uint64_t reconnects[2];         /* by idemp_server */
    _Atomic uint64_t buckets[NBUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    _Atomic uint64_t duration_sum_ns;       /* ns: integer atomics add without a CAS loop */
    _Atomic uint64_t duration_count;
    _Atomic int64_t oldest_pending_us; /* < 0: no pending rows */
    /* pauses by SQLSTATE: a state is written once, before the count that publishes it */
    char paused_state[PAUSED_MAX][6];
    _Atomic uint64_t paused[PAUSED_MAX];
    _Atomic size_t npaused;
    _Atomic uint64_t lag_buckets[NLAG + 1];
    _Atomic uint64_t lag_sum_ns, lag_count;
    /* by event type: types[0..ntypes) are set before serving; index ntypes is "other" */
    char *types[TYPES_MAX];
    size_t ntypes;
    _Atomic uint64_t by_type[TYPES_MAX + 1][IDEMP_OUT_COUNT];
    /* health: HEALTH_* bits, and a pause's SQLSTATE in bytes 1..5; written by the loop's
     * thread, read by the HTTP thread in one load */
    _Atomic uint64_t health;
    _Atomic int64_t outbox_rows[2]; /* pending, failed; < 0 = not known yet */
    idemp_http_t *http;
};

#define HEALTH_KNOWN 1u
#define HEALTH_PG 2u
#define HEALTH_AMQP 4u

idemp_metrics_t *idemp_metrics_new(idemp_role role)
{
    idemp_metrics_t *m = calloc(1, sizeof *m);
    if (m == NULL)
        return NULL;
    m->role = role;
    for (size_t i = 0; i < IDEMP_M_COUNT; i++)
        atomic_init(&m->counters[i], 0);
    for (size_t i = 0; i < IDEMP_DL_COUNT; i++)
        atomic_init(&m->dead_letters[i], 0);
    atomic_init(&m->reconnects[0], 0);
    atomic_init(&m->reconnects[1], 0);
    for (size_t i = 0; i <= NBUCKETS; i++)
        atomic_init(&m->buckets[i], 0);
    atomic_init(&m->duration_sum_ns, 0);
    atomic_init(&m->duration_count, 0);
    atomic_init(&m->oldest_pending_us, -1);
    for (size_t i = 0; i < PAUSED_MAX; i++)
        atomic_init(&m->paused[i], 0);
    atomic_init(&m->npaused, 0);
    for (size_t i = 0; i <= NLAG; i++)
        atomic_init(&m->lag_buckets[i], 0);
    atomic_init(&m->lag_sum_ns, 0);
    atomic_init(&m->lag_count, 0);
    for (size_t i = 0; i <= TYPES_MAX; i++)
        for (size_t o = 0; o < IDEMP_OUT_COUNT; o++)
            atomic_init(&m->by_type[i][o], 0);
    atomic_init(&m->health, 0);
    atomic_init(&m->outbox_rows[0], -1);
    atomic_init(&m->outbox_rows[1], -1);
    return m;
}

void idemp_metrics_free(idemp_metrics_t *m)
{
    if (m == NULL)
        return;
    idemp_http_stop(m->http); /* also closes the listen socket */
    for (size_t i = 0; i < m->ntypes; i++)
        free(m->types[i]);
    free(m);
}

void idemp_metrics_add(idemp_metrics_t *m, idemp_counter c, uint64_t n)
{
    if (m == NULL || c < 0 || c >= IDEMP_M_COUNT)
        return;
    atomic_fetch_add_explicit(&m->counters[c], n, memory_order_relaxed);
}

void idemp_metrics_dead_letter(idemp_metrics_t *m, idemp_dl_code code)
{
    if (m == NULL || code <= IDEMP_DL_NONE || code >= IDEMP_DL_COUNT)
        return;
    atomic_fetch_add_explicit(&m->dead_letters[code], 1, memory_order_relaxed);
}

int idemp_metrics_event_types(idemp_metrics_t *m, const char *const *types, size_t n)
{
    if (m == NULL || m->http != NULL)
        return IDEM_OK; /* the HTTP thread may be reading: set them before serving */
    for (size_t i = 0; i < n && m->ntypes < TYPES_MAX; i++) {
        if (types[i] == NULL || strcmp(types[i], "other") == 0)
            continue;
        m->types[m->ntypes] = strdup(types[i]);
        if (m->types[m->ntypes] == NULL)
            return IDEM_ERR_NOMEM;
        m->ntypes++;
    }
    return IDEM_OK;
}

void idemp_metrics_event(idemp_metrics_t *m, const char *event_type, idemp_outcome outcome)
{
    if (m == NULL || outcome < 0 || outcome >= IDEMP_OUT_COUNT)
        return;
    size_t i = 0;
    while (i < m->ntypes && (event_type == NULL || strcmp(m->types[i], event_type) != 0))
        i++;
    atomic_fetch_add_explicit(&m->by_type[i][outcome], 1, memory_order_relaxed);
}

void idemp_metrics_reconnect(idemp_metrics_t *m, idemp_server server)
{
    if (m == NULL || (server != IDEMP_SERVER_POSTGRES && server != IDEMP_SERVER_RABBITMQ))
        return;
    atomic_fetch_add_explicit(&m->reconnects[server], 1, memory_order_relaxed);
}

void idemp_metrics_paused(idemp_metrics_t *m, const char *sqlstate)
{
    if (m == NULL)
        return;
    char st[6];
    size_t k = 0;
    for (; sqlstate != NULL && sqlstate[k] && k < 5; k++) {
        char ch = sqlstate[k];
        st[k] = (ch >= '0' && ch <= '9') || (ch >= 'A' && ch <= 'Z') ? ch : '?';
    }
    st[k] = '\0';
    /* only this (the loop's) thread writes; the HTTP thread reads up to npaused */
    size_t n = atomic_load_explicit(&m->npaused, memory_order_acquire);
    size_t i = 0;
    while (i < n && strcmp(m->paused_state[i], st) != 0)
        i++;
    if (i == n) {
        if (n == PAUSED_MAX)
            i = n - 1; /* "other" */
        else {
            memcpy(m->paused_state[i], n == PAUSED_MAX - 1 ? "other" : st, 6);
            atomic_store_explicit(&m->npaused, n + 1, memory_order_release);
        }
    }
    atomic_fetch_add_explicit(&m->paused[i], 1, memory_order_relaxed);
}

void idemp_metrics_batch_duration(idemp_metrics_t *m, double seconds)
{
    if (m == NULL || !(seconds >= 0.0) || isinf(seconds))
        return;
    size_t b = 0;
    while (b < NBUCKETS && seconds > bucket_le[b])
        b++;
    atomic_fetch_add_explicit(&m->buckets[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->duration_sum_ns, (uint64_t)llround(seconds * 1e9),
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&m->duration_count, 1, memory_order_relaxed);
}

void idemp_metrics_lag(idemp_metrics_t *m, double seconds)
{
    if (m == NULL || !(seconds >= 0.0) || isinf(seconds))
        return;
    size_t b = 0;
    while (b < NLAG && seconds > lag_le[b])
        b++;
    atomic_fetch_add_explicit(&m->lag_buckets[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lag_sum_ns, (uint64_t)llround(seconds * 1e9),
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lag_count, 1, memory_order_relaxed);
}

void idemp_metrics_oldest_pending(idemp_metrics_t *m, double seconds)
{
    if (m == NULL)
        return;
    int64_t us = (seconds >= 0.0 && !isinf(seconds)) ? (int64_t)llround(seconds * 1e6) : -1;
    atomic_store_explicit(&m->oldest_pending_us, us, memory_order_relaxed);
}

void idemp_metrics_health(idemp_metrics_t *m, bool pg_up, bool amqp_up, const char *paused)
{
    if (m == NULL)
        return;
    uint64_t h = HEALTH_KNOWN | (pg_up ? HEALTH_PG : 0) | (amqp_up ? HEALTH_AMQP : 0);
    for (int k = 0; paused != NULL && k < 5 && paused[k] != '\0'; k++) {
        char ch = paused[k];
        bool ok = (ch >= '0' && ch <= '9') || (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z');
        h |= (uint64_t)(unsigned char)(ok ? ch : '?') << (8 * (k + 1));
    }
    atomic_store_explicit(&m->health, h, memory_order_relaxed);
}

void idemp_metrics_outbox_rows(idemp_metrics_t *m, int64_t pending, int64_t failed)
{
    if (m == NULL)
        return;
    atomic_store_explicit(&m->outbox_rows[0], pending, memory_order_relaxed);
    atomic_store_explicit(&m->outbox_rows[1], failed, memory_order_relaxed);
}

static bool healthy(uint64_t h)
{
    return (h & (HEALTH_KNOWN | HEALTH_PG | HEALTH_AMQP)) ==
               (HEALTH_KNOWN | HEALTH_PG | HEALTH_AMQP) &&
           (h >> 8) == 0;
}

int idemp_health_line(bool pg_up, bool amqp_up, const char *paused, char *buf, size_t sz)
{
    if (!pg_up)
        snprintf(buf, sz, "postgres: disconnected\n");
    else if (!amqp_up)
        snprintf(buf, sz, "rabbitmq: disconnected\n");
    else if (paused != NULL && paused[0] != '\0')
        snprintf(buf, sz, "paused: %s\n", paused);
    else {
        snprintf(buf, sz, "ok\n");
        return 200;
    }
    return 503;
}

int idemp_metrics_healthz(idemp_metrics_t *m, char *buf, size_t sz)
{
    uint64_t h = m != NULL ? atomic_load_explicit(&m->health, memory_order_relaxed) : 0;
    if (!(h & HEALTH_KNOWN)) {
        snprintf(buf, sz, "starting\n");
        return 503;
    }
    char state[6] = {0};
    for (int k = 0; k < 5; k++)
        state[k] = (char)((h >> (8 * (k + 1))) & 0xff);
    return idemp_health_line(h & HEALTH_PG, h & HEALTH_AMQP, state, buf, sz);
}

uint64_t idemp_metrics_get(const idemp_metrics_t *m, idemp_counter c)
{
    if (m == NULL || c < 0 || c >= IDEMP_M_COUNT)
        return 0;
    /* atomic_load takes a non-const pointer in some C libraries' <stdatomic.h> */
    return atomic_load_explicit((_Atomic uint64_t *)&m->counters[c], memory_order_relaxed);
}

/* ---------------------------------------------------------------- rendering */

static uint64_t ld(_Atomic uint64_t *a)
{
    return atomic_load_explicit(a, memory_order_relaxed);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
            (unsigned long long)v);
}

static void histogram(FILE *f, const char *name, const char *help, const double *le, size_t n,
                      _Atomic uint64_t *buckets, _Atomic uint64_t *sum_ns,
                      _Atomic uint64_t *count_a)
{
    /* Read the count first: a concurrent observation may then only make buckets run ahead of
     * _count by a little, never behind. */
    uint64_t count = ld(count_a);
    uint64_t sum = ld(sum_ns);
    fprintf(f, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t b = 0; b < n; b++) {
        cum += ld(&buckets[b]);
        fprintf(f, "%s_bucket{le=\"%g\"} %llu\n", name, le[b], (unsigned long long)cum);
    }
    cum += ld(&buckets[n]);
    if (cum < count)
        cum = count;
    fprintf(f, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    fprintf(f, "%s_sum %.9f\n", name, (double)sum / 1e9);
    fprintf(f, "%s_count %llu\n", name, (unsigned long long)cum);
}

/* A label value in text format: backslash, double quote and newline escaped. */
static void label_value(FILE *f, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            fputc('\\', f);
        if (*v == '\n')
            fputs("\\n", f);
        else
            fputc(*v, f);
    }
}

static void render_by_type(idemp_metrics_t *m, FILE *f)
{
    static const char *const outcome[IDEMP_OUT_COUNT] = {"applied", "duplicate", "dead_lettered"};
    fprintf(f, "# HELP idem_consumer_events_total Deliveries settled, by event type (\"other\" for "
               "types without a handler) and outcome.\n"
               "# TYPE idem_consumer_events_total counter\n");
    for (size_t i = 0; i <= m->ntypes; i++)
        for (int o = 0; o < IDEMP_OUT_COUNT; o++) {
            fputs("idem_consumer_events_total{event_type=\"", f);
            label_value(f, i < m->ntypes ? m->types[i] : "other");
            fprintf(f, "\",outcome=\"%s\"} %llu\n", outcome[o],
                    (unsigned long long)ld(&m->by_type[i][o]));
        }
}

static void render(idemp_metrics_t *m, FILE *f)
{
    fprintf(f,
            "# HELP idem_build_info The idem version serving these metrics.\n"
            "# TYPE idem_build_info gauge\nidem_build_info{version=\"%s\"} 1\n",
            IDEM_VERSION);
    if (m->role == IDEMP_ROLE_RELAY) {
        counter(f, "idem_relay_published_total", "Outbox rows published and marked sent.",
                ld(&m->counters[IDEMP_M_RELAY_PUBLISHED]));
        counter(f, "idem_relay_publish_failures_total",
                "Publishes that were returned, nacked or failed.",
                ld(&m->counters[IDEMP_M_RELAY_PUBLISH_FAILURES]));
        counter(f, "idem_relay_parked_total", "Outbox rows marked failed after their last attempt.",
                ld(&m->counters[IDEMP_M_RELAY_PARKED]));
        int64_t us = atomic_load_explicit(&m->oldest_pending_us, memory_order_relaxed);
        fprintf(f,
                "# HELP idem_outbox_oldest_pending_seconds Age of the oldest pending outbox row "
                "(0 when there is none).\n"
                "# TYPE idem_outbox_oldest_pending_seconds gauge\n"
                "idem_outbox_oldest_pending_seconds %.6f\n",
                us > 0 ? (double)us / 1e6 : 0.0);
        int64_t pending = atomic_load_explicit(&m->outbox_rows[0], memory_order_relaxed);
        int64_t failed = atomic_load_explicit(&m->outbox_rows[1], memory_order_relaxed);
        fprintf(f, "# HELP idem_outbox_rows Outbox rows by status (pending, failed), counted every "
                   "few seconds.\n# TYPE idem_outbox_rows gauge\n");
        if (pending >= 0 && failed >= 0)
            fprintf(f,
                    "idem_outbox_rows{status=\"pending\"} %lld\n"
                    "idem_outbox_rows{status=\"failed\"} %lld\n",
                    (long long)pending, (long long)failed);
    } else {
        fprintf(f,
                "# HELP idem_consumer_up 1 while connected to PostgreSQL and RabbitMQ and not "
                "paused, else 0.\n# TYPE idem_consumer_up gauge\nidem_consumer_up %d\n",
                healthy(atomic_load_explicit(&m->health, memory_order_relaxed)) ? 1 : 0);
        counter(f, "idem_consumer_applied_total",
                "Deliveries claimed and committed (duplicates excluded).",
                ld(&m->counters[IDEMP_M_CONSUMER_APPLIED]));
        counter(f, "idem_consumer_duplicates_total",
                "Deliveries whose event this consumer had already applied.",
                ld(&m->counters[IDEMP_M_CONSUMER_DUPLICATES]));
        counter(f, "idem_consumer_handler_errors_total", "Failed handler tries.",
                ld(&m->counters[IDEMP_M_CONSUMER_HANDLER_ERRORS]));
        fprintf(f, "# HELP idem_consumer_dead_lettered_total Deliveries dead-lettered, by "
                   "reason code.\n# TYPE idem_consumer_dead_lettered_total counter\n");
        for (int c = IDEMP_DL_NONE + 1; c < IDEMP_DL_COUNT; c++)
            fprintf(f, "idem_consumer_dead_lettered_total{code=\"%s\"} %llu\n",
                    idemp_dl_code_name((idemp_dl_code)c),
                    (unsigned long long)ld(&m->dead_letters[c]));
        fprintf(f, "# HELP idem_consumer_paused_total Times the consumer paused (backed off "
                   "without spending a try), by SQLSTATE.\n"
                   "# TYPE idem_consumer_paused_total counter\n");
        size_t np = atomic_load_explicit(&m->npaused, memory_order_acquire);
        for (size_t i = 0; i < np; i++)
            fprintf(f, "idem_consumer_paused_total{sqlstate=\"%s\"} %llu\n", m->paused_state[i],
                    (unsigned long long)ld(&m->paused[i]));
        render_by_type(m, f);
    }
    fprintf(f, "# HELP idem_reconnects_total Reconnections to a server after a lost or failed "
               "connection.\n# TYPE idem_reconnects_total counter\n");
    fprintf(f, "idem_reconnects_total{server=\"postgres\"} %llu\n",
            (unsigned long long)ld(&m->reconnects[IDEMP_SERVER_POSTGRES]));
    fprintf(f, "idem_reconnects_total{server=\"rabbitmq\"} %llu\n",
            (unsigned long long)ld(&m->reconnects[IDEMP_SERVER_RABBITMQ]));

    histogram(f, "idem_batch_duration_seconds", "Time to process one batch (claim to commit).",
              bucket_le, NBUCKETS, m->buckets, &m->duration_sum_ns, &m->duration_count);
    if (m->role == IDEMP_ROLE_CONSUMER)
        histogram(f, "idem_consumer_lag_seconds",
                  "Commit time minus the message's timestamp (whole seconds on the wire).", lag_le,
                  NLAG, m->lag_buckets, &m->lag_sum_ns, &m->lag_count);
}

static void render_cb(void *ud, FILE *f)
{
    render(ud, f);
}

static int health_cb(void *ud, char *buf, size_t sz)
{
    return idemp_metrics_healthz(ud, buf, sz);
}

int idemp_metrics_serve(idemp_metrics_t *m, const char *addr, int port, idem_error_t *err)
{
    if (m == NULL || port == 0)
        return IDEM_OK;
    if (m->http != NULL)
        return idem_error_set(err, IDEM_ERR_INVALID, "metrics are already being served");
    int fd = idemp_http_listen(addr, port, "metrics", err);
    if (fd < 0)
        return err != NULL ? err->code : IDEM_ERR_IO;
    m->http = idemp_http_start(fd, render_cb, health_cb, m, err);
    if (m->http == NULL) {
        close(fd);
        return err != NULL ? err->code : IDEM_ERR_IO;
    }
    return IDEM_OK;
}
