/* consumer.c - the exactly-once consumer runtime.
 *
 * One loop: take a batch of deliveries; validate each envelope (bad ones go to the DLQ at once);
 * in one transaction claim the event ids in consumed_events and run the handlers; COMMIT; then
 * ack. A failing handler makes the batch fall back to one transaction per delivery so the
 * failure stays with its own delivery. Acks happen only after a successful COMMIT; a commit
 * whose outcome is unknown is never acked (the redelivery is absorbed by the claim). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <amqp.h>
#include <amqp_framing.h>

#include <idem/consumer.h>
#include <idem/log.h>

#include "rmq.h"
#include "backoff.h"
#include "clock.h"
#include "envelope.h"
#include "event.h"
#include "fault.h"
#include "metrics.h"
#include "pg.h"
#include "registry.h"

#define TICK_MS 200
#define RETRY_BASE_MS 1000
#define RETRY_MAX_MS 30000
#define RECONNECT_BASE_MS 250
#define RECONNECT_MAX_MS 5000
#define CONFIRM_TIMEOUT_MS 30000

/* Claims a set of event ids for a consumer; returns the ids actually claimed (new). */
#define SQL_CLAIM                                                                                  \
    "INSERT INTO consumed_events (consumer, event_id) "                                            \
    "SELECT $1, e FROM unnest($2::uuid[]) AS e ON CONFLICT DO NOTHING RETURNING event_id"

enum dstate {
    D_NEW,   /* received, not yet validated */
    D_READY, /* valid, waiting for (re)processing */
    D_ACK,   /* committed or duplicate or dead-lettered: ack it */
    D_DEAD,  /* to be dead-lettered (dl_code set) */
    D_RETRY, /* transient failure: wait until due */
};

typedef struct delivery {
    amqp_envelope_t env;
    idemp_envelope_t ev;
    const idemp_handler_entry_t *handler;
    enum dstate state;
    int tries;
    int64_t due_ms;
    idemp_dl_code dl_code;
    char detail[512];
} delivery_t;

struct idem_consumer {
    char *consumer, *queue, *dlq, *pg_conninfo, *amqp_url, *exchange;
    char **binds; /* NULL-terminated, owned */
    idem_consumer_config_t cfg;
    idemp_registry_t *reg;
    idemp_pg_t *pg;
    idemp_amqp_t *in;  /* consuming connection */
    idemp_amqp_t *out; /* dead-letter publishing connection (confirms) */
    idemp_metrics_t *metrics;
    idemp_backoff_t pg_backoff, amqp_backoff;
    int64_t pg_next_ms, amqp_next_ms;
    bool pg_was_up, amqp_was_up;
    delivery_t **held; /* retries waiting, and deliveries whose dead-letter must be redone */
    size_t nheld, capheld;
    volatile sig_atomic_t no_stop;
};

static const char *const LOGC = "consumer";

void idem_consumer_config_init(idem_consumer_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->exchange = "billing.events";
    cfg->prefetch = 200;
    cfg->batch_max = 100;
    cfg->linger_ms = 1;
    cfg->dedup_window_ms = 30LL * 86400 * 1000;
    cfg->max_message_bytes = 1048576;
    cfg->max_retries = 5;
}

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

idem_consumer_t *idem_consumer_new(const idem_consumer_config_t *cfg, idem_error_t *err)
{
    if (cfg->consumer == NULL || cfg->consumer[0] == '\0' || cfg->queue == NULL ||
        cfg->queue[0] == '\0') {
        idem_error_set(err, IDEM_ERR_INVALID, "a consumer name and a queue are required");
        return NULL;
    }
    if (cfg->prefetch < 1 || cfg->prefetch > 65535 || cfg->batch_max < 1 || cfg->max_retries < 0 ||
        cfg->max_message_bytes < 1) {
        idem_error_set(err, IDEM_ERR_INVALID, "invalid consumer configuration");
        return NULL;
    }
    idem_consumer_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        goto nomem;
    c->cfg = *cfg;
    c->consumer = strdup(cfg->consumer);
    c->queue = strdup(cfg->queue);
    c->pg_conninfo = strdup(cfg->pg_conninfo ? cfg->pg_conninfo : "");
    c->amqp_url = strdup(cfg->amqp_url ? cfg->amqp_url : "amqp://guest:guest@127.0.0.1:5672");
    c->exchange = strdup(cfg->exchange ? cfg->exchange : "billing.events");
    size_t ql = strlen(cfg->queue);
    c->dlq = malloc(ql + 5);
    if (!c->consumer || !c->queue || !c->pg_conninfo || !c->amqp_url || !c->exchange || !c->dlq)
        goto nomem;
    memcpy(c->dlq, cfg->queue, ql);
    memcpy(c->dlq + ql, ".dlq", 5);
    if (cfg->binds != NULL) {
        size_t n = 0;
        while (cfg->binds[n])
            n++;
        c->binds = calloc(n + 1, sizeof *c->binds);
        if (c->binds == NULL)
            goto nomem;
        for (size_t i = 0; i < n; i++)
            if ((c->binds[i] = dup_or_null(cfg->binds[i])) == NULL)
                goto nomem;
    }
    c->reg = idemp_registry_new();
    c->pg = idemp_pg_new(c->pg_conninfo);
    if (c->reg == NULL || c->pg == NULL)
        goto nomem;
    c->in = idemp_amqp_new(c->amqp_url, err);
    c->out = c->in ? idemp_amqp_new(c->amqp_url, err) : NULL;
    if (c->out == NULL) {
        idem_consumer_free(c);
        return NULL;
    }
    c->cfg.consumer = c->consumer;
    c->cfg.queue = c->queue;
    idemp_backoff_init(&c->pg_backoff, RECONNECT_BASE_MS, RECONNECT_MAX_MS);
    idemp_backoff_init(&c->amqp_backoff, RECONNECT_BASE_MS, RECONNECT_MAX_MS);
    return c;
nomem:
    idem_consumer_free(c);
    idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    return NULL;
}

int idem_consumer_register(idem_consumer_t *c, const char *event_type, idem_handler_fn fn,
                           void *userdata)
{
    return idemp_registry_add(c->reg, event_type, fn, userdata);
}

static void delivery_free(delivery_t *d)
{
    if (d == NULL)
        return;
    json_decref(d->ev.payload);
    amqp_destroy_envelope(&d->env);
    free(d);
}

static void drop_held(idem_consumer_t *c)
{
    for (size_t i = 0; i < c->nheld; i++)
        delivery_free(c->held[i]);
    c->nheld = 0;
}

void idem_consumer_free(idem_consumer_t *c)
{
    if (c == NULL)
        return;
    drop_held(c);
    free(c->held);
    idemp_metrics_free(c->metrics);
    idemp_amqp_free(c->in);
    idemp_amqp_free(c->out);
    idemp_pg_free(c->pg);
    idemp_registry_free(c->reg);
    if (c->binds != NULL)
        for (char **b = c->binds; *b; b++)
            free(*b);
    free(c->binds);
    free(c->consumer);
    free(c->queue);
    free(c->dlq);
    free(c->pg_conninfo);
    free(c->amqp_url);
    free(c->exchange);
    free(c);
}

static bool stopping(const idem_consumer_t *c)
{
    return c->cfg.stop != NULL && *c->cfg.stop;
}

static void log_delivery(idem_log_level lvl, const idem_consumer_t *c, const delivery_t *d,
                         const char *fmt, const char *a)
{
    const char *kv[] = {"consumer",   c->consumer,
                        "queue",      c->queue,
                        "event_id",   d->ev.event_id[0] ? d->ev.event_id : NULL,
                        "event_type", d->ev.event_type[0] ? d->ev.event_type : NULL,
                        NULL};
    idem_log(lvl, LOGC, kv, fmt, a);
}

/* ---- connections ------------------------------------------------------------------------ */

static int setup_topology(idem_consumer_t *c, idem_error_t *err)
{
    int rc = idemp_amqp_declare_exchange(c->in, c->exchange, err);
    if (rc == IDEM_OK)
        rc = idemp_amqp_declare_queue(c->in, c->dlq, false, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_amqp_declare_queue(c->in, c->queue, true, c->dlq, err);
    if (rc != IDEM_OK)
        return rc;
    if (c->binds != NULL) {
        for (char **b = c->binds; *b && rc == IDEM_OK; b++)
            rc = idemp_amqp_bind(c->in, c->queue, c->exchange, *b, err);
    } else {
        for (size_t i = 0; i < idemp_registry_count(c->reg) && rc == IDEM_OK; i++)
            rc = idemp_amqp_bind(c->in, c->queue, c->exchange, idemp_registry_type(c->reg, i), err);
    }
    if (rc == IDEM_OK)
        rc = idemp_amqp_consume(c->in, c->queue, c->cfg.prefetch, err);
    return rc;
}

/* Makes sure both servers are connected; false while one is still down (backing off). */
static bool ensure_connected(idem_consumer_t *c)
{
    int64_t now = idemp_now_ms();
    if (!idemp_pg_connected(c->pg) && now >= c->pg_next_ms) {
        idem_error_t err = {0};
        if (c->pg_was_up)
            idemp_metrics_reconnect(c->metrics, IDEMP_SERVER_POSTGRES);
        if (idemp_pg_connect(c->pg, &err) == IDEM_OK) {
            idemp_backoff_reset(&c->pg_backoff);
            const char *kv[] = {"consumer", c->consumer, "server", idemp_pg_where_str(c->pg), NULL};
            idem_log(IDEM_LOG_INFO, LOGC, kv, "connected to PostgreSQL");
            c->pg_was_up = true;
        } else {
            int64_t wait = idemp_backoff_next(&c->pg_backoff);
            wait = wait < RECONNECT_BASE_MS ? RECONNECT_BASE_MS : wait;
            c->pg_next_ms = now + wait;
            char w[32];
            snprintf(w, sizeof w, "%lld", (long long)wait);
            const char *kv[] = {"consumer", c->consumer, "retry_in_ms", w, NULL};
            idem_log(IDEM_LOG_WARN, LOGC, kv, "%s", err.text);
        }
    }
    if ((!idemp_amqp_connected(c->in) || !idemp_amqp_connected(c->out)) && now >= c->amqp_next_ms) {
        /* deliveries of a dead channel come again from the broker: forget them */
        drop_held(c);
        idem_error_t err = {0};
        if (c->amqp_was_up)
            idemp_metrics_reconnect(c->metrics, IDEMP_SERVER_RABBITMQ);
        int rc = idemp_amqp_connect(c->in, false, &err);
        if (rc == IDEM_OK)
            rc = setup_topology(c, &err);
        if (rc == IDEM_OK)
            rc = idemp_amqp_connect(c->out, true, &err);
        if (rc == IDEM_OK) {
            idemp_backoff_reset(&c->amqp_backoff);
            const char *kv[] = {"consumer", c->consumer, "queue",
                                c->queue,   "server",    idemp_amqp_where(c->in),
                                NULL};
            idem_log(IDEM_LOG_INFO, LOGC, kv, "connected to RabbitMQ, consuming");
            c->amqp_was_up = true;
        } else {
            idemp_amqp_disconnect(c->in);
            idemp_amqp_disconnect(c->out);
            int64_t wait = idemp_backoff_next(&c->amqp_backoff);
            wait = wait < RECONNECT_BASE_MS ? RECONNECT_BASE_MS : wait;
            c->amqp_next_ms = now + wait;
            char w[32];
            snprintf(w, sizeof w, "%lld", (long long)wait);
            const char *kv[] = {"consumer", c->consumer, "queue", c->queue, "retry_in_ms", w, NULL};
            idem_log(IDEM_LOG_WARN, LOGC, kv, "%s", err.text);
        }
    }
    return idemp_pg_connected(c->pg) && idemp_amqp_connected(c->in) && idemp_amqp_connected(c->out);
}

static void pg_lost(idem_consumer_t *c, const char *why)
{
    const char *kv[] = {"consumer", c->consumer, "server", idemp_pg_where_str(c->pg), NULL};
    idem_log(IDEM_LOG_WARN, LOGC, kv, "PostgreSQL connection lost, reconnecting: %s", why);
    idemp_pg_disconnect(c->pg);
    c->pg_next_ms = idemp_now_ms();
}

/* ---- envelope ---------------------------------------------------------------------------- */

static idemp_str_t bytes_str(amqp_bytes_t b)
{
    return (idemp_str_t){b.bytes, b.len};
}

static const amqp_field_value_t *header(const amqp_basic_properties_t *p, const char *name)
{
    if (!(p->_flags & AMQP_BASIC_HEADERS_FLAG))
        return NULL;
    size_t n = strlen(name);
    for (int i = 0; i < p->headers.num_entries; i++) {
        const amqp_table_entry_t *e = &p->headers.entries[i];
        if (e->key.len == n && memcmp(e->key.bytes, name, n) == 0)
            return &e->value;
    }
    return NULL;
}

static idemp_str_t header_str(const amqp_basic_properties_t *p, const char *name, bool *bad)
{
    const amqp_field_value_t *v = header(p, name);
    *bad = false;
    if (v == NULL)
        return (idemp_str_t){NULL, 0};
    if (v->kind == AMQP_FIELD_KIND_UTF8 || v->kind == AMQP_FIELD_KIND_BYTES)
        return bytes_str(v->value.bytes);
    *bad = true;
    return (idemp_str_t){NULL, 0};
}

static void validate(idem_consumer_t *c, delivery_t *d)
{
    const amqp_basic_properties_t *p = &d->env.message.properties;
    idemp_envelope_in_t in;
    bool bad_type;
    memset(&in, 0, sizeof in);
    if (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG)
        in.message_id = bytes_str(p->message_id);
    in.hdr_event_id = header_str(p, "event_id", &in.hdr_event_id_bad_kind);
    if (p->_flags & AMQP_BASIC_TYPE_FLAG)
        in.type = bytes_str(p->type);
    in.hdr_event_type = header_str(p, "event_type", &bad_type);
    in.routing_key = bytes_str(d->env.routing_key);
    if (p->_flags & AMQP_BASIC_TIMESTAMP_FLAG) {
        in.has_timestamp = true;
        in.timestamp_s = (int64_t)p->timestamp;
    }
    in.body = d->env.message.body.bytes;
    in.body_len = d->env.message.body.len;

    d->dl_code = idemp_envelope_parse(&in, c->cfg.max_message_bytes, idemp_wall_ms(),
                                      c->cfg.dedup_window_ms, &d->ev, d->detail, sizeof d->detail);
    if (d->dl_code == IDEMP_DL_NONE) {
        d->handler = idemp_registry_find(c->reg, d->ev.event_type);
        if (d->handler == NULL) {
            d->dl_code = IDEMP_DL_UNKNOWN_TYPE;
            snprintf(d->detail, sizeof d->detail, "no handler for event type '%.200s'",
                     d->ev.event_type);
        }
    }
    d->state = d->dl_code == IDEMP_DL_NONE ? D_READY : D_DEAD;
}

/* ---- dead letters ------------------------------------------------------------------------ */

struct dl_wait {
    bool returned;
};

static void on_dl_confirm(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                          const amqp_message_t *m)
{
    struct dl_wait *w = ud;
    if (kind == IDEMP_CONFIRM_RETURN || kind == IDEMP_CONFIRM_NACK)
        w->returned = true;
}

/* Publishes d to the DLQ with its original body, properties and headers plus x-idem-error, and
 * waits for the broker's confirm. On success d becomes D_ACK. */
static int dead_letter(idem_consumer_t *c, delivery_t *d)
{
    char reason[700];
    snprintf(reason, sizeof reason, "%s: %s", idemp_dl_code_name(d->dl_code), d->detail);
    amqp_basic_properties_t props = d->env.message.properties;
    int old = (props._flags & AMQP_BASIC_HEADERS_FLAG) ? props.headers.num_entries : 0;
    amqp_table_entry_t *entries = calloc((size_t)old + 1, sizeof *entries);
    if (entries == NULL)
        return IDEM_ERR_NOMEM;
    int n = 0;
    for (int i = 0; i < old; i++) {
        const amqp_table_entry_t *e = &props.headers.entries[i];
        if (e->key.len == 12 && memcmp(e->key.bytes, "x-idem-error", 12) == 0)
            continue; /* a message dead-lettered again carries only its latest reason */
        entries[n++] = *e;
    }
    entries[n].key = amqp_cstring_bytes("x-idem-error");
    entries[n].value.kind = AMQP_FIELD_KIND_UTF8;
    entries[n].value.value.bytes = amqp_cstring_bytes(reason);
    n++;
    props.headers.num_entries = n;
    props.headers.entries = entries;
    props._flags |= AMQP_BASIC_HEADERS_FLAG;

    idem_error_t err = {0};
    uint64_t tag = 0;
    int rc = idemp_amqp_publish(c->out, "", c->dlq, true, &props, d->env.message.body.bytes,
                                d->env.message.body.len, &tag, &err);
    struct dl_wait w = {false};
    if (rc == IDEM_OK)
        rc = idemp_amqp_wait_confirms(c->out, tag, CONFIRM_TIMEOUT_MS, on_dl_confirm, &w, &err);
    free(entries);
    if (rc == IDEM_OK && w.returned)
        rc = idem_error_set(&err, IDEM_ERR_AMQP, "the broker did not accept the message into %s",
                            c->dlq);
    if (rc != IDEM_OK) {
        log_delivery(IDEM_LOG_ERROR, c, d, "dead-lettering failed, will retry: %s", err.text);
        if (rc == IDEM_ERR_AMQP_LOST || rc == IDEM_ERR_TIMEOUT || rc == IDEM_ERR_AMQP)
            idemp_amqp_disconnect(c->out);
        return rc;
    }
    idemp_metrics_dead_letter(c->metrics, d->dl_code);
    {
        const char *kv[] = {"consumer",   c->consumer,
                            "queue",      c->queue,
                            "event_id",   d->ev.event_id[0] ? d->ev.event_id : NULL,
                            "event_type", d->ev.event_type[0] ? d->ev.event_type : NULL,
                            "code",       idemp_dl_code_name(d->dl_code),
                            NULL};
        idem_log(IDEM_LOG_WARN, LOGC, kv, "dead-lettered to %s: %s", c->dlq, reason);
    }
    d->state = D_ACK;
    return IDEM_OK;
}

/* ---- the transaction --------------------------------------------------------------------- */

typedef enum { TX_OK, TX_FALLBACK, TX_PG_LOST } tx_result;

/* Writes a PostgreSQL array literal of the event ids of ds[0..n) (UUIDs need no quoting). */
static char *id_array(delivery_t **ds, size_t n)
{
    char *s = malloc(n * 37 + 3);
    if (s == NULL)
        return NULL;
    size_t o = 0;
    s[o++] = '{';
    for (size_t i = 0; i < n; i++) {
        if (i > 0)
            s[o++] = ',';
        memcpy(s + o, ds[i]->ev.event_id, 36);
        o += 36;
    }
    s[o++] = '}';
    s[o] = '\0';
    return s;
}

/* Decides the outcome of apply()'s transaction; see apply(). */
static tx_result settle(idem_consumer_t *c, delivery_t **ds, size_t n, bool single,
                        const bool *claimed, int rc, idem_error_t *err, delivery_t *failed,
                        idem_outcome outcome, uint64_t *applied, uint64_t *dups)
{
    if (rc == IDEM_ERR_PG_LOST || !idemp_pg_connected(c->pg)) {
        pg_lost(c, err->text);
        return TX_PG_LOST; /* nothing acked: a COMMIT with unknown outcome is never acked */
    }
    if (rc != IDEM_OK) {
        /* the server refused a statement of the batch (e.g. a serialization failure) */
        if (!single) {
            const char *kv[] = {"consumer", c->consumer, NULL};
            idem_log(IDEM_LOG_DEBUG, LOGC, kv, "batch of %zu failed, one by one: %s", n, err->text);
            return TX_FALLBACK;
        }
        failed = ds[0];
        outcome = idemp_pg_is_transient(err) ? IDEM_RETRY : IDEM_REJECT;
        snprintf(failed->detail, sizeof failed->detail, "%s", err->text);
    }
    if (failed != NULL && !single)
        return TX_FALLBACK;
    if (failed != NULL) {
        /* a single delivery: settle its failure */
        if (outcome == IDEM_INVALID) {
            failed->dl_code = IDEMP_DL_INVALID_PAYLOAD;
            failed->state = D_DEAD;
            return TX_OK;
        }
        idemp_metrics_add(c->metrics, IDEMP_M_CONSUMER_HANDLER_ERRORS, 1);
        if (outcome == IDEM_REJECT) {
            failed->dl_code = IDEMP_DL_HANDLER_REJECTED;
            failed->state = D_DEAD;
            return TX_OK;
        }
        failed->tries++;
        if (failed->tries > c->cfg.max_retries) {
            char last[sizeof failed->detail];
            snprintf(last, sizeof last, "%s", failed->detail);
            snprintf(failed->detail, sizeof failed->detail, "%d tries, last error: %.400s",
                     failed->tries, last);
            failed->dl_code = IDEMP_DL_RETRIES_EXHAUSTED;
            failed->state = D_DEAD;
            return TX_OK;
        }
        int64_t delay = idemp_backoff_delay(RETRY_BASE_MS, RETRY_MAX_MS, failed->tries);
        failed->due_ms = idemp_now_ms() + delay;
        failed->state = D_RETRY;
        char msg[700];
        snprintf(msg, sizeof msg, "try %d failed, retrying in %lld ms: %.500s", failed->tries,
                 (long long)delay, failed->detail);
        log_delivery(IDEM_LOG_WARN, c, failed, "%s", msg);
        return TX_OK;
    }
    for (size_t i = 0; i < n; i++) {
        ds[i]->state = D_ACK;
        if (claimed[i])
            (*applied)++;
        else
            (*dups)++;
    }
    return TX_OK;
}

/* Claims, runs handlers, commits. all-or-nothing for ds[0..n). On TX_OK every delivery is
 * D_ACK (applied or duplicate). With single set, a handler failure is settled on the delivery
 * (retry or dead-letter) and the result is TX_OK as well; otherwise it is TX_FALLBACK. */
static tx_result apply(idem_consumer_t *c, delivery_t **ds, size_t n, bool single,
                       uint64_t *applied, uint64_t *dups)
{
    idem_error_t err = {0};
    char *ids = id_array(ds, n);
    if (ids == NULL)
        return TX_FALLBACK;
    bool *claimed = calloc(n, sizeof *claimed);
    PGresult *res = NULL;
    /* a batch is pipelined: BEGIN and the claim travel together, handler statements queue,
     * COMMIT and a sync read everything back; any error sends the batch to one-by-one */
    int rc = single ? IDEM_OK : idemp_pg_pipeline_begin(c->pg, &err);
    if (rc == IDEM_OK)
        rc = idemp_pg_command(c->pg, "BEGIN", &err);
    if (rc == IDEM_OK) {
        const char *params[] = {c->consumer, ids};
        rc = idemp_pg_exec(c->pg, SQL_CLAIM, 2, params, &res, &err);
    }
    free(ids);
    if (rc == IDEM_OK && claimed != NULL) {
        for (int r = 0; r < PQntuples(res); r++) {
            const char *id = PQgetvalue(res, r, 0);
            for (size_t i = 0; i < n; i++)
                if (!claimed[i] && memcmp(ds[i]->ev.event_id, id, 36) == 0) {
                    claimed[i] = true; /* a repeat of an id in the same batch stays unclaimed */
                    break;
                }
        }
    }
    PQclear(res);

    idem_outcome outcome = IDEM_DONE;
    delivery_t *failed = NULL;
    struct idem_event ev;
    for (size_t i = 0; rc == IDEM_OK && i < n && claimed != NULL; i++) {
        if (!claimed[i])
            continue;
        delivery_t *d = ds[i];
        idemp_event_init(&ev, d->ev.event_id, d->ev.event_type, c->consumer, d->ev.payload, c->pg);
        outcome = d->handler->fn(&ev, d->handler->userdata);
        if (ev.pg_lost || !idemp_pg_connected(c->pg)) {
            rc = IDEM_ERR_PG_LOST;
            idem_error_set(&err, rc, "connection lost in handler: %s", ev.detail);
            break;
        }
        if (outcome != IDEM_DONE) {
            failed = d;
            snprintf(d->detail, sizeof d->detail, "%s",
                     ev.failed ? ev.detail : "handler failed without a reason");
            break;
        }
    }
    if (rc == IDEM_OK && claimed == NULL)
        rc = IDEM_ERR_NOMEM;

    if (rc == IDEM_OK && failed == NULL) {
        idemp_fault_point("consumer.before_commit");
        rc = idemp_pg_command(c->pg, "COMMIT", &err);
        if (rc == IDEM_OK)
            rc = idemp_pg_pipeline_end(c->pg, &err); /* the COMMIT's outcome is known here */
        if (rc == IDEM_OK)
            idemp_fault_point("consumer.after_commit");
    }
    if (rc != IDEM_OK || failed != NULL) {
        idem_error_t rb = {0};
        idemp_pg_pipeline_end(c->pg, rc == IDEM_OK ? &err : &rb);
        if (rc == IDEM_OK && err.code != 0)
            rc = err.code;
        if (idemp_pg_connected(c->pg))
            idemp_pg_command(c->pg, "ROLLBACK", &rb);
    }

    tx_result result = settle(c, ds, n, single, claimed, rc, &err, failed, outcome, applied, dups);
    free(claimed);
    return result;
}

/* Stable order for the batch transaction: by subscription, then delivery order, so that
 * concurrent consumers lock rows in the same order. */
static int by_subscription(const void *a, const void *b)
{
    const delivery_t *x = *(delivery_t *const *)a, *y = *(delivery_t *const *)b;
    int r = strcmp(x->ev.subscription_id, y->ev.subscription_id);
    if (r != 0)
        return r;
    return x->env.delivery_tag < y->env.delivery_tag ? -1
                                                     : x->env.delivery_tag > y->env.delivery_tag;
}

static void hold(idem_consumer_t *c, delivery_t *d)
{
    if (c->nheld == c->capheld) {
        size_t cap = c->capheld ? c->capheld * 2 : 64;
        delivery_t **h = realloc(c->held, cap * sizeof *h);
        if (h == NULL) {
            /* cannot keep it: leave it unacked on the channel; it returns on reconnect */
            log_delivery(IDEM_LOG_ERROR, c, d, "%s", "out of memory holding a retry");
            delivery_free(d);
            return;
        }
        c->held = h;
        c->capheld = cap;
    }
    c->held[c->nheld++] = d;
}

/* Acks every D_ACK delivery of ds: one multiple-ack when nothing older is still held. */
static void ack_all(idem_consumer_t *c, delivery_t **ds, size_t n)
{
    uint64_t max_tag = 0;
    size_t nack = 0;
    for (size_t i = 0; i < n; i++)
        if (ds[i]->state == D_ACK) {
            nack++;
            if (ds[i]->env.delivery_tag > max_tag)
                max_tag = ds[i]->env.delivery_tag;
        }
    if (nack == 0)
        return;
    bool older_pending = false;
    for (size_t i = 0; i < c->nheld && !older_pending; i++)
        older_pending = c->held[i]->env.delivery_tag < max_tag;
    for (size_t i = 0; i < n && !older_pending; i++)
        older_pending = ds[i]->state != D_ACK && ds[i]->env.delivery_tag < max_tag;
    idem_error_t err = {0};
    int rc = IDEM_OK;
    if (!older_pending) {
        rc = idemp_amqp_ack(c->in, max_tag, true, &err);
    } else {
        for (size_t i = 0; i < n && rc == IDEM_OK; i++)
            if (ds[i]->state == D_ACK)
                rc = idemp_amqp_ack(c->in, ds[i]->env.delivery_tag, false, &err);
    }
    if (rc != IDEM_OK) {
        const char *kv[] = {"consumer", c->consumer, "queue", c->queue, NULL};
        idem_log(IDEM_LOG_WARN, LOGC, kv,
                 "ack failed (committed work will be redelivered and deduplicated): %s", err.text);
    }
}

/* Processes one batch. Every delivery of ds ends acked (and freed), held for a retry, or left
 * unacked for the broker to redeliver. */
static void process(idem_consumer_t *c, delivery_t **ds, size_t n)
{
    int64_t t0 = idemp_now_ms();
    delivery_t **ready = malloc(n * sizeof *ready);
    size_t nready = 0;
    uint64_t applied = 0, dups = 0;
    if (ready == NULL)
        return; /* unacked: redelivered after a reconnect */

    for (size_t i = 0; i < n; i++) {
        if (ds[i]->state == D_NEW)
            validate(c, ds[i]);
        if (ds[i]->state == D_READY || ds[i]->state == D_RETRY)
            ready[nready++] = ds[i];
    }

    bool pg_down = false;
    if (nready > 0) {
        qsort(ready, nready, sizeof *ready, by_subscription);
        tx_result r = apply(c, ready, nready, nready == 1, &applied, &dups);
        if (r == TX_FALLBACK) {
            for (size_t i = 0; i < nready && r != TX_PG_LOST; i++)
                r = apply(c, &ready[i], 1, true, &applied, &dups);
        }
        pg_down = r == TX_PG_LOST;
    }

    for (size_t i = 0; i < n; i++)
        if (ds[i]->state == D_DEAD && idemp_amqp_connected(c->out))
            dead_letter(c, ds[i]);

    idemp_metrics_add(c->metrics, IDEMP_M_CONSUMER_APPLIED, applied);
    idemp_metrics_add(c->metrics, IDEMP_M_CONSUMER_DUPLICATES, dups);

    /* keep what is not done; ack the rest */
    int64_t now = idemp_now_ms();
    for (size_t i = 0; i < n; i++) {
        delivery_t *d = ds[i];
        if (d->state == D_ACK)
            continue;
        if (d->state == D_READY || (pg_down && d->state != D_DEAD)) {
            d->state = D_RETRY; /* not a try: PostgreSQL is away, redo it after reconnecting */
            d->due_ms = now;
        }
        hold(c, d);
    }
    ack_all(c, ds, n);
    for (size_t i = 0; i < n; i++)
        if (ds[i]->state == D_ACK)
            delivery_free(ds[i]);
    free(ready);
    if (nready > 0) {
        idemp_metrics_batch_duration(c->metrics, (double)(idemp_now_ms() - t0) / 1000.0);
        if (applied + dups > 0) {
            char a[24], b[24], m[24];
            snprintf(a, sizeof a, "%llu", (unsigned long long)applied);
            snprintf(b, sizeof b, "%llu", (unsigned long long)dups);
            snprintf(m, sizeof m, "%lld", (long long)(idemp_now_ms() - t0));
            const char *kv[] = {"consumer", c->consumer, "applied", a,   "duplicates",
                                b,          "ms",        m,         NULL};
            idem_log(IDEM_LOG_DEBUG, LOGC, kv, "batch committed and acked");
        }
    }
}

/* ---- the loop ---------------------------------------------------------------------------- */

/* Moves due held deliveries into batch; returns the time until the next one is due. */
static int64_t take_due(idem_consumer_t *c, delivery_t **batch, size_t *n, size_t max)
{
    int64_t now = idemp_now_ms(), next = TICK_MS;
    size_t keep = 0;
    for (size_t i = 0; i < c->nheld; i++) {
        delivery_t *d = c->held[i];
        bool due = d->state == D_DEAD || d->due_ms <= now;
        if (due && *n < max && (d->state != D_DEAD || idemp_amqp_connected(c->out))) {
            batch[(*n)++] = d;
        } else {
            c->held[keep++] = d;
            int64_t left = d->state == D_DEAD ? TICK_MS : d->due_ms - now;
            if (left < next)
                next = left < 0 ? 0 : left;
        }
    }
    c->nheld = keep;
    return next;
}

int idem_consumer_run(idem_consumer_t *c, idem_error_t *err)
{
    if (idemp_registry_count(c->reg) == 0)
        return idem_error_set(err, IDEM_ERR_INVALID, "no handlers registered");
    if (c->cfg.stop == NULL)
        c->cfg.stop = &c->no_stop;
    if (c->cfg.metrics_port > 0) {
        c->metrics = idemp_metrics_new(IDEMP_ROLE_CONSUMER);
        if (c->metrics == NULL)
            return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        int rc = idemp_metrics_serve(c->metrics, c->cfg.metrics_port, err);
        if (rc != IDEM_OK)
            return rc;
    }
    size_t max = (size_t)c->cfg.batch_max;
    delivery_t **batch = calloc(max, sizeof *batch);
    if (batch == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    {
        const char *kv[] = {"consumer", c->consumer, "queue", c->queue, NULL};
        idem_log(IDEM_LOG_INFO, LOGC, kv, "starting");
    }

    while (!stopping(c)) {
        if (!ensure_connected(c)) {
            idemp_sleep_ms(TICK_MS / 2, c->cfg.stop);
            continue;
        }
        size_t n = 0;
        int64_t wait = take_due(c, batch, &n, max);
        int64_t first_deadline = idemp_now_ms() + (n > 0 ? 0 : wait);
        int64_t linger_deadline = -1;
        idem_error_t aerr = {0};
        int rc = IDEM_OK;
        while (n < max) {
            int64_t now = idemp_now_ms();
            int64_t timeout;
            if (n == 0)
                timeout = first_deadline - now;
            else {
                if (linger_deadline < 0)
                    linger_deadline = now + c->cfg.linger_ms;
                timeout = idemp_amqp_buffered(c->in) ? 0 : linger_deadline - now;
            }
            if (timeout < 0)
                timeout = 0;
            delivery_t *d = calloc(1, sizeof *d);
            if (d == NULL)
                break;
            rc = idemp_amqp_next(c->in, &d->env, timeout, &aerr);
            if (rc != IDEM_OK) {
                free(d);
                break;
            }
            d->state = D_NEW;
            batch[n++] = d;
            if (stopping(c))
                break;
        }
        if (rc != IDEM_OK && rc != IDEM_ERR_TIMEOUT) {
            const char *kv[] = {"consumer", c->consumer, "queue", c->queue, NULL};
            idem_log(IDEM_LOG_WARN, LOGC, kv, "RabbitMQ connection lost, reconnecting: %s",
                     aerr.text);
            for (size_t i = 0; i < n; i++)
                delivery_free(batch[i]); /* unacked: the broker redelivers them */
            idemp_amqp_disconnect(c->in);
            idemp_amqp_disconnect(c->out);
            c->amqp_next_ms = idemp_now_ms();
            continue;
        }
        if (n > 0)
            process(c, batch, n);
    }
    free(batch);
    {
        const char *kv[] = {"consumer", c->consumer, "queue", c->queue, NULL};
        idem_log(IDEM_LOG_INFO, LOGC, kv, "stopped");
    }
    drop_held(c);
    idemp_amqp_disconnect(c->in);
    idemp_amqp_disconnect(c->out);
    idemp_pg_disconnect(c->pg);
    return IDEM_OK;
}
