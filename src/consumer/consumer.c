/* consumer.c - the exactly-once consumer runtime: lifecycle, connections, topology, the loop.
 *
 * One loop: read deliveries into the window (validated on arrival; bad ones are dead-lettered at
 * once), pick the ones that may go now (consumer_window.c), try them in one transaction
 * (consumer_tx.c), dead-letter what failed for good, ack what is done. Acks happen only after a
 * successful COMMIT; a commit whose outcome is unknown is never acked (the redelivery is absorbed
 * by the claim). A delivery is only ever forgotten unacked together with its channel, so the
 * broker gives it back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/consumer.h>
#include <idem/log.h>

#include "clock.h"
#include "consumer_int.h"

#define TICK_MS 200
#define PAUSE_BASE_MS 250
#define PAUSE_MAX_MS 5000

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
    cfg->heartbeat_s = -1;
    cfg->partitions = 1;
    cfg->lock_timeout_ms = 5000;
    cfg->statement_timeout_ms = 30000;
    cfg->metrics_addr = "127.0.0.1";
}

/* The consumed queues: QUEUE, or the partitions of the list (all when none is given). */
static bool make_queues(idem_consumer_t *c, const idem_consumer_config_t *cfg)
{
    int p = cfg->partitions;
    int n = p == 1 ? 1 : (cfg->partition_list ? cfg->npartition_list : p);
    c->queues = calloc((size_t)n, sizeof *c->queues);
    c->queue_part = calloc((size_t)n, sizeof *c->queue_part);
    if (c->queues == NULL || c->queue_part == NULL)
        return false;
    c->nqueues = n;
    for (int i = 0; i < n; i++) {
        int part = cfg->partition_list ? cfg->partition_list[i] : i;
        c->queue_part[i] = p == 1 ? -1 : part;
        c->queues[i] =
            p == 1 ? strdup(cfg->queue) : idemp_consumer_name("%s.p%d", cfg->queue, part);
        if (c->queues[i] == NULL)
            return false;
    }
    return true;
}

static bool valid_config(const idem_consumer_config_t *cfg, idem_error_t *err)
{
    if (cfg->consumer == NULL || cfg->consumer[0] == '\0' || cfg->queue == NULL ||
        cfg->queue[0] == '\0') {
        idem_error_set(err, IDEM_ERR_INVALID, "a consumer name and a queue are required");
        return false;
    }
    if (strlen(cfg->queue) > 200) {
        idem_error_set(err, IDEM_ERR_INVALID, "the queue name is longer than 200 bytes");
        return false;
    }
    if (cfg->prefetch < 1 || cfg->prefetch > 65535 || cfg->batch_max < 1 ||
        cfg->batch_max > 10000 || cfg->max_retries < 0 || cfg->max_retries > 1000 ||
        cfg->max_message_bytes < 1 || cfg->max_message_bytes > (1LL << 30) ||
        cfg->dedup_window_ms < 1000 || cfg->linger_ms < 0 || cfg->linger_ms > 60000 ||
        cfg->heartbeat_s < -1 || cfg->heartbeat_s > 65535 || cfg->partitions < 1 ||
        cfg->partitions > IDEM_PARTITIONS_MAX || cfg->lock_timeout_ms < 0 ||
        cfg->statement_timeout_ms < 0 || cfg->lock_timeout_ms > 86400000LL ||
        cfg->statement_timeout_ms > 86400000LL) {
        idem_error_set(err, IDEM_ERR_INVALID, "invalid consumer configuration");
        return false;
    }
    for (int i = 0; cfg->partition_list && i < cfg->npartition_list; i++)
        if (cfg->partition_list[i] < 0 || cfg->partition_list[i] >= cfg->partitions) {
            idem_error_set(err, IDEM_ERR_INVALID, "partition %d is not in 0..%d",
                           cfg->partition_list[i], cfg->partitions - 1);
            return false;
        }
    for (const char *const *t = cfg->trusted_publishers; t != NULL && *t != NULL; t++)
        if ((*t)[0] == '\0' || strlen(*t) > 255) {
            idem_error_set(err, IDEM_ERR_INVALID,
                           "a trusted publisher must be a RabbitMQ user name (1-255 bytes)");
            return false;
        }
    if (cfg->partition_list && (cfg->npartition_list < 1 || cfg->partitions == 1)) {
        idem_error_set(err, IDEM_ERR_INVALID, "--partition needs --partitions greater than 1");
        return false;
    }
    return true;
}

/* A copy of a NULL-terminated list of strings into *out (NULL for NULL); false when out of
 * memory (what was copied stays in *out for the caller's free). */
static bool copy_names(const char *const *names, char ***out)
{
    *out = NULL;
    if (names == NULL)
        return true;
    size_t n = 0;
    while (names[n])
        n++;
    if ((*out = calloc(n + 1, sizeof **out)) == NULL)
        return false;
    for (size_t i = 0; i < n; i++)
        if (((*out)[i] = strdup(names[i])) == NULL)
            return false;
    return true;
}

static void free_names(char **names)
{
    for (char **p = names; p != NULL && *p != NULL; p++)
        free(*p);
    free(names);
}

idem_consumer_t *idem_consumer_new(const idem_consumer_config_t *cfg, idem_error_t *err)
{
    if (!valid_config(cfg, err))
        return NULL;
    idem_consumer_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        goto nomem;
    c->cfg = *cfg;
    c->cfg.partition_list = NULL;
    c->consumer = strdup(cfg->consumer);
    c->queue = strdup(cfg->queue);
    c->pg_conninfo = strdup(cfg->pg_conninfo ? cfg->pg_conninfo : "");
    c->amqp_url = strdup(cfg->amqp_url ? cfg->amqp_url : "amqp://guest:guest@127.0.0.1:5672");
    c->exchange = strdup(cfg->exchange ? cfg->exchange : "billing.events");
    c->dlq = idemp_consumer_name("%s.dlq", cfg->queue, 0);
    c->dlx = idemp_consumer_name("%s.dlx", cfg->queue, 0);
    c->part_exchange = idemp_consumer_name("%s.part", cfg->queue, 0);
    c->unkeyed_exchange = idemp_consumer_name("%s.part.unkeyed", cfg->queue, 0);
    if (!c->consumer || !c->queue || !c->pg_conninfo || !c->amqp_url || !c->exchange || !c->dlq ||
        !c->dlx || !c->part_exchange || !c->unkeyed_exchange || !make_queues(c, cfg))
        goto nomem;
    if (!copy_names(cfg->binds, &c->binds) ||
        !copy_names(cfg->trusted_publishers, &c->trusted_publishers))
        goto nomem;
    c->cfg.trusted_publishers = (const char *const *)c->trusted_publishers;
    c->reg = idemp_registry_new();
    if (c->reg == NULL)
        goto nomem;
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        if ((c->pgs[i] = idemp_pg_new(c->pg_conninfo, LOGC)) == NULL)
            goto nomem;
    c->pg = c->pgs[0];
    c->in = idemp_amqp_new(c->amqp_url, LOGC, cfg->heartbeat_s, err);
    c->out = c->in ? idemp_amqp_new(c->amqp_url, LOGC, cfg->heartbeat_s, err) : NULL;
    if (c->out == NULL) {
        idem_consumer_free(c);
        return NULL;
    }
    if (cfg->amqp_password != NULL && (idemp_amqp_set_password(c->in, cfg->amqp_password) != 0 ||
                                       idemp_amqp_set_password(c->out, cfg->amqp_password) != 0)) {
        idem_error_set(err, IDEM_ERR_INVALID, "the AMQP password is too long");
        idem_consumer_free(c);
        return NULL;
    }
    c->cfg.consumer = c->consumer;
    c->cfg.queue = c->queue;
    c->cfg.amqp_password = NULL;
    snprintf(c->settings[0], sizeof c->settings[0], "%lld", (long long)cfg->lock_timeout_ms);
    snprintf(c->settings[1], sizeof c->settings[1], "%lld", (long long)cfg->statement_timeout_ms);
    snprintf(c->window_ms, sizeof c->window_ms, "%lld", (long long)cfg->dedup_window_ms);
    idemp_backoff_init(&c->pause_backoff, PAUSE_BASE_MS, PAUSE_MAX_MS);
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

int idem_consumer_require_migration(idem_consumer_t *c, const char *version)
{
    size_t n = 0;
    while (c->required[n] != NULL)
        n++;
    if (version == NULL || *version == '\0' || n + 1 >= sizeof c->required / sizeof c->required[0])
        return IDEM_ERR_INVALID;
    for (size_t i = 0; i < n; i++)
        if (strcmp(c->required[i], version) == 0)
            return IDEM_OK;
    c->required[n] = strdup(version);
    return c->required[n] != NULL ? IDEM_OK : IDEM_ERR_NOMEM;
}

void idem_consumer_free(idem_consumer_t *c)
{
    if (c == NULL)
        return;
    idemp_consumer_drop_window(c);
    free(c->win);
    idemp_metrics_free(c->metrics);
    idemp_amqp_free(c->in);
    idemp_amqp_free(c->out);
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        idemp_pg_free(c->pgs[i]);
    idemp_registry_free(c->reg);
    free_names(c->binds);
    free_names(c->trusted_publishers);
    for (int i = 0; i < c->nqueues; i++)
        free(c->queues[i]);
    free(c->queues);
    for (size_t i = 0; i < c->nsql_handlers; i++) {
        sql_handler_t *h = c->sql_handlers[i];
        free(h->call);
        free(h->signature);
        free(h);
    }
    free(c->sql_handlers);
    free(c->consumer);
    free(c->queue);
    free(c->dlq);
    free(c->dlx);
    free(c->part_exchange);
    free(c->unkeyed_exchange);
    for (size_t i = 0; c->required[i] != NULL; i++)
        free(c->required[i]);
    free(c->queue_part);
    free(c->pg_conninfo);
    free(c->amqp_url);
    free(c->exchange);
    free(c);
}

/* ---- connections -------------------------------------------------------------------------- */

/* Connects RabbitMQ (both connections, topology, consuming) when down. IDEM_OK when up; a
 * negative status for configurations that cannot work (fatal); IDEM_ERR_AMQP_CONNECT while
 * backing off. */
static int ensure_amqp(idem_consumer_t *c, idem_error_t *err)
{
    bool in_up = idemp_amqp_connected(c->in);
    if (in_up && idemp_amqp_connected(c->out))
        return IDEM_OK;
    idem_error_t e = {0};
    int rc;
    if (!in_up) {
        bool again = false;
        if (idemp_amqp_connected(c->out))
            idemp_amqp_disconnect(c->out, "the consuming connection is down; starting both again");
        idemp_consumer_drop_window(
            c); /* its channel is gone: the broker gives the deliveries back */
        rc = idemp_amqp_ensure(c->in, false, &again, &e);
        if (rc != IDEM_OK)
            return IDEM_ERR_AMQP_CONNECT;
        rc = idemp_consumer_topology(c, &e);
        if (rc == IDEM_ERR_REFUSED || rc == IDEM_ERR_NOT_FOUND) {
            idem_error_set(err, rc, "%s", e.text);
            return rc;
        }
        if (rc != IDEM_OK) {
            idemp_consumer_channel_lost(c, e.text);
            return IDEM_ERR_AMQP_CONNECT;
        }
        if (again)
            idemp_metrics_reconnect(c->metrics, IDEMP_SERVER_RABBITMQ);
        const char *kv[] = {"consumer", c->consumer,
                            "queue",    c->queue,
                            "server",   idemp_amqp_where(c->in),
                            "tls",      idemp_amqp_tls(c->in) ? "on" : "off",
                            NULL};
        idem_log(IDEM_LOG_INFO, LOGC, kv, "connected to RabbitMQ, consuming %d queue%s", c->nqueues,
                 c->nqueues == 1 ? "" : "s");
    }
    /* the dead-letter connection alone: the deliveries in hand stay */
    rc = idemp_amqp_ensure(c->out, true, NULL, &e);
    return rc == IDEM_OK ? IDEM_OK : IDEM_ERR_AMQP_CONNECT;
}

static bool ensure_pg(idem_consumer_t *c)
{
    bool again = false;
    if (c->pg == NULL || idemp_pg_ensure(c->pg, &again, NULL) != IDEM_OK)
        return false;
    if (again)
        idemp_metrics_reconnect(c->metrics, IDEMP_SERVER_POSTGRES);
    return true;
}

/* How long to wait for new deliveries when nothing can be tried at once: until the next retry
 * is due, the pause ends or PostgreSQL may be tried again, at most a tick. */
static int64_t idle_wait(idem_consumer_t *c, bool can_apply, int64_t now)
{
    int64_t next;
    if (can_apply) {
        next = idemp_window_next_due(c->win, c->nwin);
    } else {
        next = now + (c->pg != NULL ? idemp_pg_retry_in_ms(c->pg) : 0);
        if (c->pause_until > next)
            next = c->pause_until;
        if (next <= now)
            next = now + 50; /* e.g. the SQL handlers' check failed: try again soon */
    }
    int64_t wait = next == INT64_MAX ? TICK_MS : next - now;
    return wait < 0 ? 0 : wait > TICK_MS ? TICK_MS : wait;
}

/* After a transaction: metrics, the debug line, and the dead letters that it decided. */
static void after_batch(idem_consumer_t *c, const tx_counts_t *counts, int64_t t0)
{
    idemp_metrics_add(c->metrics, IDEMP_M_CONSUMER_APPLIED, counts->applied);
    idemp_metrics_add(c->metrics, IDEMP_M_CONSUMER_DUPLICATES, counts->duplicates);
    double secs = (double)(idemp_now_ms() - t0) / 1000.0;
    idemp_metrics_batch_duration(c->metrics, secs);
    if (counts->applied + counts->duplicates > 0) {
        char a[24], b[24], m[24];
        snprintf(a, sizeof a, "%llu", (unsigned long long)counts->applied);
        snprintf(b, sizeof b, "%llu", (unsigned long long)counts->duplicates);
        snprintf(m, sizeof m, "%.1f", secs * 1000.0);
        const char *kv[] = {"consumer", c->consumer, "applied", a, "duplicates", b, "ms", m, NULL};
        idem_log(IDEM_LOG_DEBUG, LOGC, kv, "batch committed");
    }
    idemp_consumer_dead_letter_all(c);
}

/* One turn of the loop. While a COMMIT is on its way, a batch goes only once it is full: until
 * then, or until that COMMIT is answered, deliveries gather (the batches adapt to the load as a
 * group commit does); acks go as soon as each COMMIT is answered. */
static void step(idem_consumer_t *c, delivery_t **pick)
{
    size_t max = (size_t)c->cfg.batch_max;
    tx_counts_t counts = {0, 0};
    int64_t t0 = idemp_now_ms();
    size_t done = idemp_consumer_take_conn(c, &counts);
    if (done > 0)
        idemp_consumer_ack_done(c); /* before waiting for deliveries that wait for these acks */
    int64_t now = idemp_now_ms();
    bool can_apply = now >= c->pause_until && ensure_pg(c) && c->sql_checked;
    bool ready = can_apply && idemp_window_pick(c->win, c->nwin, now, pick, max) > 0;
    bool busy = idemp_consumer_busy(c);
    /* with a COMMIT on its way, only what has already arrived is read */
    if (!idemp_consumer_read(c, ready || busy ? 0 : idle_wait(c, can_apply, now), !busy))
        return;
    /* the dead-letter connection is idle most of the time: answer its heartbeats */
    idem_error_t e = {0};
    if (idemp_amqp_service(c->out, &e) != IDEM_OK)
        idemp_amqp_disconnect(c->out, e.text);
    idemp_consumer_dead_letter_all(c);
    done += idemp_consumer_collect(c, false, &counts); /* what committed meanwhile */
    busy = idemp_consumer_busy(c);
    now = idemp_now_ms();
    size_t n = can_apply ? idemp_window_pick(c->win, c->nwin, now, pick, max) : 0;
    if (n > 0 && (n == max || !busy)) {
        idemp_consumer_apply(c, pick, n, &counts);
    } else if (busy) {
        /* a batch that is not full waits while a COMMIT is on its way: until deliveries come or
         * that COMMIT is answered */
        idemp_consumer_wait(c, TICK_MS);
        done += idemp_consumer_collect(c, false, &counts);
        n = 0;
    }
    if (n > 0 || done > 0)
        after_batch(c, &counts, t0);
    idemp_consumer_ack_done(c);
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
        size_t nt = idemp_registry_count(c->reg);
        const char **types = calloc(nt, sizeof *types);
        if (types == NULL)
            return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < nt; i++)
            types[i] = idemp_registry_type(c->reg, i);
        int rc = idemp_metrics_event_types(c->metrics, types, nt);
        free(types);
        if (rc != IDEM_OK)
            return idem_error_set(err, rc, "out of memory");
        rc = idemp_metrics_serve(c->metrics, c->cfg.metrics_addr, c->cfg.metrics_port, err);
        if (rc != IDEM_OK)
            return rc;
    }
    delivery_t **pick = calloc((size_t)c->cfg.batch_max, sizeof *pick);
    if (pick == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    {
        const char *kv[] = {"consumer", c->consumer, "queue", c->queue, NULL};
        idem_log(IDEM_LOG_INFO, LOGC, kv, "starting");
    }
    int result = IDEM_OK;
    while (!idemp_consumer_stopping(c)) {
        if (c->cfg.reload != NULL && *c->cfg.reload)
            idemp_consumer_reload(c);
        if (!c->sql_checked && ensure_pg(c)) {
            idem_error_t e = {0};
            result = idemp_consumer_check_sql(c, &e);
            if (result == IDEM_ERR_NOT_FOUND) {
                idem_error_set(err, result, "%s", e.text);
                break;
            }
            c->sql_checked = result == IDEM_OK;
            result = IDEM_OK;
        }
        int rc = ensure_amqp(c, err);
        if (rc == IDEM_ERR_REFUSED || rc == IDEM_ERR_NOT_FOUND) {
            result = rc;
            break;
        }
        idemp_consumer_watch_pg(c);
        idemp_consumer_report(c);
        if (rc != IDEM_OK) {
            int64_t wait = idemp_amqp_retry_in_ms(c->in);
            idemp_sleep_ms(wait < 50 ? 50 : wait > TICK_MS ? TICK_MS : wait, c->cfg.stop);
            continue;
        }
        step(c, pick);
    }
    free(pick);
    idemp_consumer_stopping_told(c);
    tx_counts_t counts = {0, 0};
    size_t settled = 0;
    while (idemp_consumer_busy(c)) /* what committed is acked before leaving */
        settled += idemp_consumer_collect(c, true, &counts);
    if (settled > 0) {
        after_batch(c, &counts, idemp_now_ms());
        idemp_consumer_ack_done(c);
    }
    {
        const char *kv[] = {"consumer", c->consumer, "queue", c->queue, NULL};
        idem_log(IDEM_LOG_INFO, LOGC, kv, "stopped");
    }
    idemp_consumer_drop_window(c); /* unacked: the broker gives them to the next consumer */
    idemp_amqp_disconnect(c->in, NULL);
    idemp_amqp_disconnect(c->out, NULL);
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        idemp_pg_disconnect(c->pgs[i], NULL);
    return result;
}
