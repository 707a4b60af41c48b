/* relay.c - the outbox relay: lifecycle, connections, the loop, the backlog gauge.
 *
 * One loop: claim due pending rows, publish them with confirms, mark the confirmed ones sent in
 * the claiming transaction, COMMIT (relay_batch.c). Order per subscription holds across relays
 * because a relay takes whole subscriptions (a transaction-level advisory lock per subscription)
 * before it reads their rows, and reads them with a snapshot taken after it holds the lock:
 * whatever the previous holder did is visible, and nobody else moves those rows until we commit.
 * A control connection LISTENs for new rows and reads the backlog gauge, outside the batches'
 * transactions. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "backoff.h"
#include "clock.h"
#include "relay_int.h"

#define GAUGE_EVERY_MS 1000
#define STATEMENT_BACKOFF_BASE_MS 200
#define STATEMENT_BACKOFF_MAX_MS 5000

#define SQL_OLDEST_PENDING                                                                         \
    "SELECT extract(epoch FROM clock_timestamp() - created_at) FROM event_outbox"                  \
    " WHERE status = 'pending' ORDER BY seq LIMIT 1"

static const char *const LOGC = "relay";

void idem_relay_config_init(idem_relay_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->exchange = "billing.events";
    cfg->batch = 200;
    cfg->max_attempts = 8;
    cfg->backoff_base_ms = 1000;
    cfg->backoff_max_ms = 5 * 60 * 1000;
    cfg->poll_interval_ms = 200;
    cfg->confirm_timeout_ms = 30000;
    cfg->lock_timeout_ms = 5000;
    cfg->statement_timeout_ms = 30000;
    cfg->heartbeat_s = -1;
    cfg->metrics_addr = "127.0.0.1";
}

idem_relay_t *idem_relay_new(const idem_relay_config_t *cfg, idem_error_t *err)
{
    if (cfg->batch < 1 || cfg->batch > 100000 || cfg->max_attempts < 1 ||
        cfg->backoff_base_ms < 0 || cfg->backoff_max_ms < cfg->backoff_base_ms ||
        cfg->backoff_max_ms > 30LL * 86400000 || cfg->poll_interval_ms < 1 ||
        cfg->poll_interval_ms > 3600000 || cfg->confirm_timeout_ms < 1 ||
        cfg->lock_timeout_ms < 0 || cfg->lock_timeout_ms > 86400000LL ||
        cfg->statement_timeout_ms < 0 || cfg->statement_timeout_ms > 86400000LL ||
        cfg->heartbeat_s < -1 || cfg->heartbeat_s > 65535) {
        idem_error_set(err, IDEM_ERR_INVALID, "invalid relay configuration");
        return NULL;
    }
    idem_relay_t *r = calloc(1, sizeof *r);
    if (r == NULL)
        goto nomem;
    r->cfg = *cfg;
    r->cfg.amqp_password = NULL;
    r->pg_conninfo = strdup(cfg->pg_conninfo ? cfg->pg_conninfo : "");
    r->amqp_url = strdup(cfg->amqp_url ? cfg->amqp_url : "amqp://guest:guest@127.0.0.1:5672");
    r->exchange = strdup(cfg->exchange ? cfg->exchange : "billing.events");
    if (!r->pg_conninfo || !r->amqp_url || !r->exchange)
        goto nomem;
    for (int i = 0; i < NSLOTS; i++) {
        r->slots[i].rows = calloc((size_t)cfg->batch, sizeof(row_t));
        r->slots[i].pg = idemp_pg_new(r->pg_conninfo, LOGC);
        if (r->slots[i].rows == NULL || r->slots[i].pg == NULL)
            goto nomem;
        idemp_pg_set_backoff(r->slots[i].pg, 200, 5000);
    }
    r->ctl = idemp_pg_new(r->pg_conninfo, LOGC);
    if (r->ctl == NULL)
        goto nomem;
    idemp_pg_set_backoff(r->ctl, 200, 5000);
    snprintf(r->settings[0], sizeof r->settings[0], "%lld", (long long)cfg->lock_timeout_ms);
    snprintf(r->settings[1], sizeof r->settings[1], "%lld", (long long)cfg->statement_timeout_ms);
    r->amqp = idemp_amqp_new(r->amqp_url, LOGC, cfg->heartbeat_s, err);
    if (r->amqp == NULL) {
        idem_relay_free(r);
        return NULL;
    }
    if (cfg->amqp_password != NULL && idemp_amqp_set_password(r->amqp, cfg->amqp_password) != 0) {
        idem_error_set(err, IDEM_ERR_INVALID, "the AMQP password is too long");
        idem_relay_free(r);
        return NULL;
    }
    return r;
nomem:
    idem_relay_free(r);
    idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    return NULL;
}

void idem_relay_free(idem_relay_t *r)
{
    if (r == NULL)
        return;
    idemp_metrics_free(r->metrics);
    idemp_amqp_free(r->amqp);
    for (int i = 0; i < NSLOTS; i++) {
        idemp_rows_free(r->slots[i].res);
        idemp_pg_free(r->slots[i].pg);
        free(r->slots[i].rows);
    }
    idemp_pg_free(r->ctl);
    free(r->pg_conninfo);
    free(r->amqp_url);
    free(r->exchange);
    free(r);
}

void idem_relay_get_stats(const idem_relay_t *r, idem_relay_stats_t *out)
{
    *out = r->stats;
}

static bool stopping(const idem_relay_t *r)
{
    return r->cfg.stop != NULL && *r->cfg.stop;
}

/* ---- connections ------------------------------------------------------------------------ */

static bool pg_up(const idem_relay_t *r)
{
    for (int i = 0; i < NSLOTS; i++)
        if (!idemp_pg_connected(r->slots[i].pg))
            return false;
    return true;
}

static int once_connect_pg(idemp_pg_t *pg, idem_error_t *err)
{
    return idemp_pg_connected(pg) ? IDEM_OK : idemp_pg_connect(pg, err);
}

/* PostgreSQL: both slots, and (as a daemon, or with metrics) the control connection. In once
 * mode one attempt, its failure returned; as a daemon with backoff. */
static int ensure_pg(idem_relay_t *r, idem_error_t *err)
{
    bool daemon = !r->cfg.once, again = false;
    int rc = IDEM_OK;
    for (int i = 0; i < NSLOTS && rc == IDEM_OK; i++) {
        bool a = false;
        rc = daemon ? idemp_pg_ensure(r->slots[i].pg, &a, NULL)
                    : once_connect_pg(r->slots[i].pg, err);
        again = again || a;
    }
    if (rc != IDEM_OK)
        return rc;
    if (again)
        idemp_metrics_reconnect(r->metrics, IDEMP_SERVER_POSTGRES);
    if (daemon || r->metrics != NULL) {
        bool was = idemp_pg_connected(r->ctl);
        rc = daemon ? idemp_pg_ensure(r->ctl, NULL, NULL) : once_connect_pg(r->ctl, err);
        if (rc == IDEM_OK && !was) {
            idem_error_t e = {0};
            if (daemon && idemp_pg_listen(r->ctl, "idem_outbox", &e) != IDEM_OK)
                idemp_pg_disconnect(r->ctl, e.text);
            r->gauge_next_ms = 0;
        }
    }
    return IDEM_OK; /* the control connection is not needed to publish */
}

static int ensure_amqp(idem_relay_t *r, idem_error_t *err)
{
    bool was = idemp_amqp_connected(r->amqp), again = false;
    int rc;
    idem_error_t e = {0};
    if (r->cfg.once)
        rc = was ? IDEM_OK : idemp_amqp_connect(r->amqp, true, &e);
    else
        rc = idemp_amqp_ensure(r->amqp, true, &again, &e);
    if (rc != IDEM_OK) {
        if (r->cfg.once)
            idem_error_set(err, IDEM_ERR_AMQP_CONNECT, "%s", e.text);
        return IDEM_ERR_AMQP_CONNECT;
    }
    if (was)
        return IDEM_OK;
    rc = idemp_amqp_declare_exchange(r->amqp, r->exchange, "topic", NULL, r->cfg.no_declare, &e);
    if (rc == IDEM_ERR_NOT_FOUND) {
        idem_error_set(err, rc, "%s (--no-declare)", e.text);
        return rc;
    }
    if (rc != IDEM_OK) {
        idemp_amqp_disconnect(r->amqp, e.text);
        if (r->cfg.once)
            idem_error_set(err, IDEM_ERR_AMQP_CONNECT, "%s", e.text);
        return IDEM_ERR_AMQP_CONNECT;
    }
    if (again)
        idemp_metrics_reconnect(r->metrics, IDEMP_SERVER_RABBITMQ);
    const char *kv[] = {"server",   idemp_amqp_where(r->amqp),
                        "exchange", r->exchange,
                        "tls",      idemp_amqp_tls(r->amqp) ? "on" : "off",
                        NULL};
    idem_log(r->cfg.once ? IDEM_LOG_DEBUG : IDEM_LOG_INFO, LOGC, kv,
             "connected to RabbitMQ, publishing with confirms");
    return IDEM_OK;
}

/* ---- the backlog gauge and waiting for work ------------------------------------------------ */

void idemp_relay_update_gauge(idem_relay_t *r, bool force)
{
    int64_t now = idemp_now_ms();
    if (r->metrics == NULL || (!force && now < r->gauge_next_ms) || !idemp_pg_connected(r->ctl))
        return;
    r->gauge_next_ms = now + GAUGE_EVERY_MS;
    idemp_rows_t *res = NULL;
    idem_error_t e = {0};
    if (idemp_pg_exec(r->ctl, SQL_OLDEST_PENDING, 0, NULL, &res, &e) != IDEM_OK)
        return;
    idemp_metrics_oldest_pending(
        r->metrics, idemp_rows_count(res) > 0 ? strtod(idemp_rows_get(res, 0, 0), NULL) : 0.0);
    idemp_rows_free(res);
}

/* Sleeps until a NOTIFY arrives or up to ms pass (or a stop), servicing the broker link. */
static void wait_for_work(idem_relay_t *r, int64_t ms)
{
    /* a NOTIFY that arrived during our own statements is already in libpq's queue, and the
     * socket will not signal it again */
    if (idemp_pg_take_notifies(r->ctl))
        return;
    int64_t end = idemp_now_ms() + ms;
    while (!stopping(r)) {
        int64_t left = end - idemp_now_ms();
        if (left <= 0)
            return;
        struct pollfd pfd[2] = {{idemp_pg_socket(r->ctl), POLLIN, 0},
                                {idemp_amqp_socket(r->amqp), POLLIN, 0}};
        int n = poll(pfd, 2, (int)(left > 100 ? 100 : left));
        if (n > 0 && (pfd[0].revents & (POLLIN | POLLHUP | POLLERR)) &&
            idemp_pg_take_notifies(r->ctl))
            return;
        idem_error_t e = {0};
        if (idemp_amqp_connected(r->amqp) && idemp_amqp_service(r->amqp, &e) != IDEM_OK) {
            idemp_amqp_disconnect(r->amqp, e.text);
            return;
        }
        idemp_relay_update_gauge(r, false);
    }
}

/* ---- the loop ---------------------------------------------------------------------------- */

static slot_t *free_slot(idem_relay_t *r)
{
    for (int k = 0; k < NSLOTS; k++)
        if (!r->slots[k].inflight)
            return &r->slots[k];
    return NULL;
}

static slot_t *oldest_inflight(idem_relay_t *r)
{
    slot_t *best = NULL;
    for (int k = 0; k < NSLOTS; k++)
        if (r->slots[k].inflight && (best == NULL || r->slots[k].order < best->order))
            best = &r->slots[k];
    return best;
}

static bool pg_side(int rc)
{
    return rc == IDEM_ERR_PG_LOST || rc == IDEM_ERR_PG_QUERY || rc == IDEM_ERR_PG_ROLLBACK ||
           rc == IDEM_ERR_PG_CONNECT;
}

/* A batch failed: PostgreSQL trouble rolls back (nothing spent) and backs off; broker trouble
 * keeps what was confirmed and reconnects. */
static void on_failure(idem_relay_t *r, int rc, idem_error_t *e)
{
    const char *kv[] = {"server", pg_side(rc) ? "postgres" : "rabbitmq", NULL};
    if (pg_side(rc) || rc == IDEM_ERR_NOMEM) {
        idemp_relay_abort_all(r);
        int64_t wait = idemp_backoff_delay(STATEMENT_BACKOFF_BASE_MS, STATEMENT_BACKOFF_MAX_MS,
                                           ++r->pg_failures);
        r->pg_wait_until = idemp_now_ms() + wait;
        idem_log(IDEM_LOG_WARN, LOGC, kv,
                 "batch rolled back, nothing spent, retrying in %lld ms: %s", (long long)wait,
                 e->text);
        return;
    }
    idemp_relay_salvage(r, rc, e);
    idem_log(IDEM_LOG_WARN, LOGC, kv,
             "broker link failed; confirmed rows marked sent, the rest stay pending: %s", e->text);
    idemp_amqp_disconnect(r->amqp, e->text);
}

/* One turn: the oldest batch is confirmed by the broker, then the next one is claimed and
 * published, then the oldest is marked and committed: the broker works on batch k+1 while
 * PostgreSQL commits batch k. *busy when there is probably more to do at once. */
static int turn(idem_relay_t *r, bool *busy, idem_error_t *e)
{
    bool claimed_any = false;
    int rc = IDEM_OK;
    slot_t *cur = oldest_inflight(r);
    if (cur == NULL) {
        size_t claimed = 0;
        cur = free_slot(r);
        rc = idemp_relay_claim(r, cur, &claimed, e);
        claimed_any = claimed > 0;
        if (rc == IDEM_OK && !cur->inflight)
            cur = NULL; /* nothing due */
    }
    if (rc == IDEM_OK && cur != NULL)
        rc = idemp_relay_confirm(r, cur, e);
    slot_t *next = rc == IDEM_OK && cur != NULL && !stopping(r) ? free_slot(r) : NULL;
    if (next != NULL) {
        size_t claimed = 0;
        rc = idemp_relay_claim(r, next, &claimed, e);
        claimed_any = claimed_any || claimed > 0;
        if (rc != IDEM_OK && pg_side(rc) && !next->inflight) {
            /* the next claim failed on its own connection: roll back only that one; cur's rows
             * were confirmed by the broker and are marked sent on theirs */
            idemp_relay_abort_slot(r, next);
            idem_error_t ce = {0};
            int crc = idemp_relay_commit(r, cur, &ce);
            if (crc != IDEM_OK) {
                *e = ce;
                return crc;
            }
            *busy = true;
            return rc;
        }
    }
    if (rc == IDEM_OK && cur != NULL)
        rc = idemp_relay_commit(r, cur, e);
    if (rc == IDEM_OK && cur != NULL)
        r->pg_failures = 0;
    *busy = claimed_any || oldest_inflight(r) != NULL;
    return rc;
}

int idem_relay_run(idem_relay_t *r, idem_error_t *err)
{
    if (r->cfg.stop == NULL)
        r->cfg.stop = &r->no_stop;
    if (r->cfg.metrics_port > 0) {
        r->metrics = idemp_metrics_new(IDEMP_ROLE_RELAY);
        if (r->metrics == NULL)
            return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        int rc = idemp_metrics_serve(r->metrics, r->cfg.metrics_addr, r->cfg.metrics_port, err);
        if (rc != IDEM_OK)
            return rc;
    }
    /* a one-shot run reports through its exit status and summary, not lifecycle lines */
    idem_log_level life = r->cfg.once ? IDEM_LOG_DEBUG : IDEM_LOG_INFO;
    idem_log(life, LOGC, NULL, "starting%s", r->cfg.once ? " (once)" : "");
    int result = IDEM_OK;
    while (!stopping(r)) {
        int rc = ensure_pg(r, err);
        if (rc == IDEM_OK)
            rc = ensure_amqp(r, err);
        if (rc != IDEM_OK && (r->cfg.once || rc == IDEM_ERR_NOT_FOUND)) {
            result = rc;
            break;
        }
        if (!pg_up(r) || !idemp_amqp_connected(r->amqp)) {
            int64_t a = idemp_amqp_retry_in_ms(r->amqp), p = idemp_pg_retry_in_ms(r->slots[0].pg);
            int64_t wait = a > p ? a : p;
            idemp_sleep_ms(wait < 50 ? 50 : wait > 200 ? 200 : wait, r->cfg.stop);
            idemp_relay_update_gauge(r, false);
            continue;
        }
        int64_t hold = r->pg_wait_until - idemp_now_ms();
        if (hold > 0) {
            wait_for_work(r, hold); /* after a failed statement */
            continue;
        }
        idemp_relay_update_gauge(r, false);
        idemp_pg_take_notifies(r->ctl);
        if (r->reopen_amqp && oldest_inflight(r) == NULL) {
            /* RabbitMQ can go on nacking a channel opened while a quorum queue elected its
             * leader: a nack gets a fresh connection before the next batch */
            r->reopen_amqp = false;
            idemp_amqp_disconnect(r->amqp,
                                  "a publish was nacked; reconnecting for a fresh channel");
            continue;
        }
        idem_error_t e = {0};
        bool busy = false;
        rc = turn(r, &busy, &e);
        if (rc != IDEM_OK) {
            on_failure(r, rc, &e);
            if (r->cfg.once) {
                idem_error_set(err, rc, "%s", e.text);
                result = rc;
                break;
            }
            continue;
        }
        if (busy)
            continue; /* more is probably due */
        if (r->cfg.once)
            break;
        wait_for_work(r, r->cfg.poll_interval_ms);
    }
    /* a stop between claim and settle: finish what was published (its confirms, mark, commit) */
    slot_t *sl;
    while ((sl = oldest_inflight(r)) != NULL) {
        idem_error_t e = {0};
        int rc = idemp_relay_commit(r, sl, &e);
        if (rc != IDEM_OK) {
            on_failure(r, rc, &e);
            break;
        }
    }
    {
        char a[24], b[24], c1[24];
        snprintf(a, sizeof a, "%llu", (unsigned long long)r->stats.published);
        snprintf(b, sizeof b, "%llu", (unsigned long long)r->stats.failures);
        snprintf(c1, sizeof c1, "%llu", (unsigned long long)r->stats.parked);
        const char *kv[] = {"published", a, "failures", b, "parked", c1, NULL};
        idem_log(life, LOGC, kv, "stopped");
    }
    idemp_amqp_disconnect(r->amqp, NULL);
    for (int i = 0; i < NSLOTS; i++)
        idemp_pg_disconnect(r->slots[i].pg, NULL);
    idemp_pg_disconnect(r->ctl, NULL);
    return result;
}
