/* relay.c - the outbox relay: lifecycle, connections, the event loop.
 *
 * Each batch: claim due pending rows, publish them with confirms, mark the confirmed ones sent in
 * the claiming transaction, COMMIT (relay_claim.c, relay_batch.c). Order per subscription holds
 * across relays because a relay takes whole subscriptions (a row lock on each one's first pending
 * row, its head) before it reads their rows, and reads them with a snapshot taken after it holds
 * the lock: whatever the previous holder did is visible, and nobody else moves those rows until
 * we commit. A subscription held by another relay costs a claim one skipped lock, however long its
 * backlog, so a relay that hangs holds back its own subscriptions only. A control connection
 * LISTENs for new rows and reads the gauges (relay_ops.c), outside the batches' transactions.
 *
 * One loop drives every batch in flight, each in its own transaction on its own connection (a
 * slot): it reads confirms as they arrive and publishes each batch's next wave, sends a batch's
 * marks and COMMIT as soon as it is settled, reads each connection's answers as they arrive, and
 * claims the next batch while earlier ones wait for the broker. Nothing blocks but poll() over
 * the sockets; statements go out as pipelines (pg_async.c). */
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "backoff.h"
#include "clock.h"
#include "relay_int.h"

#define STATEMENT_BACKOFF_BASE_MS 200
#define STATEMENT_BACKOFF_MAX_MS 5000
#define STEP1_QUIET_MS 50

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

/* Batches in flight: IDEMP_RELAY_INFLIGHT_DEFAULT, or IDEM_RELAY_INFLIGHT (2-8); two in once
 * mode; at most IDEMP_RELAY_INFLIGHT_ROWS rows in all, but never fewer than two batches. */
static int inflight_slots(const idem_relay_config_t *cfg)
{
    long depth = IDEMP_RELAY_INFLIGHT_DEFAULT;
    const char *env = getenv("IDEM_RELAY_INFLIGHT");
    if (env != NULL && *env != '\0') {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (*end == '\0' && v >= 2 && v <= IDEMP_RELAY_INFLIGHT_MAX)
            depth = v;
    }
    if (cfg->once)
        depth = 2;
    long by_rows = IDEMP_RELAY_INFLIGHT_ROWS / cfg->batch;
    if (depth > by_rows)
        depth = by_rows;
    return depth < 2 ? 2 : (int)depth;
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
    snprintf(r->cursor, sizeof r->cursor, "00000000-0000-0000-0000-000000000000");
    r->pg_conninfo = strdup(cfg->pg_conninfo ? cfg->pg_conninfo : "");
    r->amqp_url = strdup(cfg->amqp_url ? cfg->amqp_url : "amqp://guest:guest@127.0.0.1:5672");
    r->exchange = strdup(cfg->exchange ? cfg->exchange : "billing.events");
    if (!r->pg_conninfo || !r->amqp_url || !r->exchange)
        goto nomem;
    r->nslots = inflight_slots(cfg);
    for (int i = 0; i < r->nslots; i++) {
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
    for (int i = 0; i < r->nslots; i++) {
        idemp_rows_free(r->slots[i].heads);
        idemp_rows_free(r->slots[i].res);
        idemp_pg_free(r->slots[i].pg);
        free(r->slots[i].rows);
    }
    idemp_pg_free(r->ctl);
    idemp_pg_free(r->rows_pg);
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

/* A NOTIFY: rows were committed while we said we were idle. */
static void notified(idem_relay_t *r)
{
    idemp_relay_busy(r);
    idemp_relay_wake(r);
}

/* ---- connections ------------------------------------------------------------------------ */

static int once_connect_pg(idemp_pg_t *pg, idem_error_t *err)
{
    return idemp_pg_connected(pg) ? IDEM_OK : idemp_pg_connect(pg, err);
}

/* PostgreSQL: the free slots' connections, and (as a daemon, or with metrics) the control
 * connection. In once mode one attempt, its failure returned; as a daemon with backoff, each
 * connection on its own (a slot whose connection is down is not used meanwhile). */
static int ensure_pg(idem_relay_t *r, idem_error_t *err)
{
    bool daemon = !r->cfg.once, again = false;
    for (int i = 0; i < r->nslots; i++) {
        slot_t *sl = &r->slots[i];
        if (sl->phase != SLOT_FREE || idemp_pg_connected(sl->pg))
            continue;
        bool a = false;
        int rc = daemon ? idemp_pg_ensure(sl->pg, &a, NULL) : once_connect_pg(sl->pg, err);
        if (rc != IDEM_OK && !daemon)
            return rc;
        again = again || a;
    }
    if (again)
        idemp_metrics_reconnect(r->metrics, IDEMP_SERVER_POSTGRES);
    if ((daemon || r->metrics != NULL) && !idemp_pg_connected(r->ctl)) {
        int rc = daemon ? idemp_pg_ensure(r->ctl, NULL, NULL) : once_connect_pg(r->ctl, err);
        if (rc == IDEM_OK) {
            idem_error_t e = {0};
            if (daemon && idemp_pg_listen(r->ctl, "idem_outbox", &e) != IDEM_OK)
                idemp_pg_disconnect(r->ctl, e.text);
            r->gauges[0].next_ms = 0;
            if (daemon)
                idemp_relay_wake_connected(r);
            idemp_relay_wake(r); /* rows may have come while nobody listened */
        }
    }
    /* the control connection is not needed to publish */
    return idemp_relay_check_schema(r, err);
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

/* ---- the loop ---------------------------------------------------------------------------- */

static bool idle(const idem_relay_t *r)
{
    for (int k = 0; k < r->nslots; k++)
        if (r->slots[k].phase != SLOT_FREE)
            return false;
    return true;
}

static bool any_in(const idem_relay_t *r, enum slot_phase a, enum slot_phase b)
{
    for (int k = 0; k < r->nslots; k++)
        if (r->slots[k].phase == a || r->slots[k].phase == b)
            return true;
    return false;
}

static bool pg_side(int rc)
{
    return rc == IDEM_ERR_PG_LOST || rc == IDEM_ERR_PG_QUERY || rc == IDEM_ERR_PG_ROLLBACK ||
           rc == IDEM_ERR_PG_CONNECT || rc == IDEM_ERR_NOMEM || rc == IDEM_ERR_INVALID;
}

/* In once mode the first failure ends the run (once every batch is finished). */
static void note_failure(idem_relay_t *r, int rc, const idem_error_t *e)
{
    if (r->cfg.once && r->fail_rc == 0) {
        r->fail_rc = rc;
        r->fail_err = *e;
    }
}

/* A statement of sl's batch failed: that transaction alone is rolled back (nothing spent; rows it
 * had published and the broker confirmed go out again later), and claims back off. Other batches
 * carry on. */
static void pg_failed(idem_relay_t *r, slot_t *sl, int rc, idem_error_t *e)
{
    idemp_relay_abort_slot(r, sl);
    int64_t wait =
        idemp_backoff_delay(STATEMENT_BACKOFF_BASE_MS, STATEMENT_BACKOFF_MAX_MS, ++r->pg_failures);
    r->pg_wait_until = idemp_now_ms() + wait;
    snprintf(r->pg_failed_state, sizeof r->pg_failed_state, "%s",
             e->sqlstate[0]           ? e->sqlstate
             : rc == IDEM_ERR_PG_LOST ? "08006"
                                      : "XX000");
    const char *kv[] = {"server", "postgres", NULL};
    if (strcmp(r->pg_failed_state, "55P03") == 0)
        idem_log(IDEM_LOG_WARN, LOGC, kv,
                 "batch rolled back, nothing spent, retrying in %lld ms: %s; it waited for a lock "
                 "held by %s",
                 (long long)wait, e->text, sl->holder[0] ? sl->holder : "a session not seen");
    else
        idem_log(IDEM_LOG_WARN, LOGC, kv,
                 "batch rolled back, nothing spent, retrying in %lld ms: %s", (long long)wait,
                 e->text);
    note_failure(r, rc, e);
}

/* The broker link failed: every batch is finished with what the broker confirmed, then the link
 * is dropped (and made again by the loop). */
static void broker_failed(idem_relay_t *r, int rc, idem_error_t *e)
{
    idemp_relay_salvage(r, rc, e);
    const char *kv[] = {"server", "rabbitmq", NULL};
    idem_log(IDEM_LOG_WARN, LOGC, kv,
             "broker link failed; confirmed rows marked sent, the rest stay pending: %s", e->text);
    idemp_amqp_disconnect(r->amqp, e->text);
    note_failure(r, rc, e);
}

static void failed(idem_relay_t *r, slot_t *sl, int rc, idem_error_t *e)
{
    if (sl != NULL && pg_side(rc))
        pg_failed(r, sl, rc, e);
    else
        broker_failed(r, rc, e);
}

/* The broker's side: confirms that have arrived, each batch's next wave, the confirm timeout. */
static bool broker_step(idem_relay_t *r)
{
    if (!idemp_amqp_connected(r->amqp))
        return false;
    idem_error_t e = {0};
    int rc = idemp_relay_take_confirms(r, &e);
    if (rc != IDEM_OK) {
        broker_failed(r, rc, &e);
        return true;
    }
    r->suspect_waiting = false;
    for (int k = 0; k < r->nslots; k++) {
        slot_t *sl = &r->slots[k];
        if (sl->phase != SLOT_PUBLISHING)
            continue;
        rc = idemp_relay_publish(r, sl, &e);
        if (rc != IDEM_OK) {
            failed(r, rc == IDEM_ERR_NOMEM ? sl : NULL, rc, &e);
            return true;
        }
    }
    int64_t now = idemp_now_ms();
    for (int k = 0; k < r->nslots; k++) {
        const slot_t *sl = &r->slots[k];
        if (sl->phase == SLOT_PUBLISHING && sl->waiting > 0 &&
            now - sl->t_heard >= r->cfg.confirm_timeout_ms) {
            idem_error_set(&e, IDEM_ERR_TIMEOUT,
                           "no publisher confirm from RabbitMQ at %s within %lld ms",
                           idemp_amqp_where(r->amqp), (long long)r->cfg.confirm_timeout_ms);
            broker_failed(r, IDEM_ERR_TIMEOUT, &e);
            return true;
        }
    }
    return false;
}

/* A pipeline of sl was answered. */
static void answered(idem_relay_t *r, slot_t *sl, int rc, idemp_rows_t **rows, idem_error_t *e)
{
    if (rc != IDEM_OK) {
        pg_failed(r, sl, rc, e);
        return;
    }
    if (sl->phase == SLOT_SETTLING) {
        bool had_rows = sl->n > 0;
        idemp_relay_settled_ok(r, sl, rows);
        r->pg_failures = 0;
        r->claimed_once = true; /* a whole claim loop went through */
        if (had_rows)
            idemp_relay_wake(r); /* its subscriptions are free again: their next rows may go */
        return;
    }
    if (stopping(r)) {
        /* claimed while asked to stop: let go of it, nothing was published */
        idemp_rows_free(rows[0]);
        rows[0] = NULL;
        rc = idemp_relay_settle(r, sl, false, e);
    } else {
        /* step 1 found less than a batch: nothing more is due but what our own batches hold,
         * unless something woke us since this claim started */
        if (sl->phase == SLOT_LOCKING) {
            int found = idemp_rows_count(rows[0]);
            if (found > 0)
                idemp_relay_busy(r);
            else
                idemp_relay_found_none(r);
            if (found < r->cfg.batch && r->wakes == sl->wakes)
                r->want_claim = false;
        }
        size_t claimed = 0;
        rc = idemp_relay_claim_step(r, sl, rows, &claimed, e);
    }
    if (rc != IDEM_OK)
        failed(r, sl, rc, e);
}

/* Step 1 of a claim was sent less than STEP1_QUIET_MS ago: our commits wait for it (see
 * claim_step). Not longer: a step 1 that takes longer may be queued behind a lock request (a
 * migration's LOCK TABLE) that itself waits for our batches in flight to commit; holding them
 * back would stall everyone until the claim's lock timeout. */
static bool step1_running(const idem_relay_t *r)
{
    int64_t now = idemp_now_ms();
    for (int k = 0; k < r->nslots; k++)
        if (r->slots[k].phase == SLOT_LOCKING && now - r->slots[k].t0 < STEP1_QUIET_MS)
            return true;
    return false;
}

/* Every connection's answers that have arrived, and each settled batch's marks sent. */
static bool pg_step(idem_relay_t *r)
{
    bool progress = false;
    for (int k = 0; k < r->nslots; k++) {
        slot_t *sl = &r->slots[k];
        idem_error_t e = {0};
        if (sl->phase == SLOT_PUBLISHING && idemp_relay_settled(sl)) {
            /* one commit at a time, so that a batch passes the fault seam relay.after_publish
             * with every earlier batch committed (the seam counts batches); not while step 1 of a
             * claim runs (see claim_step) */
            if (any_in(r, SLOT_SETTLING, SLOT_SETTLING) || step1_running(r))
                continue;
            int rc = idemp_relay_settle(r, sl, true, &e);
            if (rc != IDEM_OK)
                pg_failed(r, sl, rc, &e);
            progress = true;
            continue;
        }
        if (sl->phase == SLOT_FREE || sl->phase == SLOT_PUBLISHING)
            continue;
        bool done = false;
        idemp_rows_t *rows[2] = {NULL, NULL};
        int rc = idemp_pg_pipeline_poll(sl->pg, &done, rows, 2, &e);
        if (done) {
            answered(r, sl, rc, rows, &e);
            progress = true;
        }
        idemp_rows_free(rows[0]);
        idemp_rows_free(rows[1]);
    }
    return progress;
}

static slot_t *free_slot(idem_relay_t *r)
{
    for (int k = 0; k < r->nslots; k++)
        if (r->slots[k].phase == SLOT_FREE && idemp_pg_connected(r->slots[k].pg))
            return &r->slots[k];
    return NULL;
}

/* Claims the next batch when rows are probably due and a slot is free: one claim at a time (two
 * at once would only take each other's rows), none after a failed statement's backoff, none while
 * a suspect waits to go out alone or a fresh channel is due. Step 1 of a claim and our own commits
 * do not overlap (but see step1_running): a commit that lets go of a subscription while step 1
 * walks past it moves its head after step 1 read it, and step 1 would pass the subscription over
 * until the next claim. */
static bool claim_step(idem_relay_t *r)
{
    int64_t now = idemp_now_ms();
    if (now >= r->next_poll_ms && !r->cfg.once) {
        idemp_relay_wake(r); /* the backstop poll (a short one while busy) */
        r->next_poll_ms = now + idemp_relay_poll_every(r);
    }
    if (!r->want_claim || stopping(r) || r->fail_rc != 0 || now < r->pg_wait_until ||
        !idemp_amqp_connected(r->amqp) || r->reopen_amqp || r->suspect_waiting || r->suspect_out ||
        any_in(r, SLOT_LOCKING, SLOT_READING) || any_in(r, SLOT_SETTLING, SLOT_SETTLING))
        return false;
    slot_t *sl = free_slot(r);
    if (sl == NULL)
        return false;
    r->next_poll_ms = now + idemp_relay_poll_every(r);
    sl->wakes = r->wakes;
    idem_error_t e = {0};
    int rc = idemp_relay_claim_start(r, sl, &e);
    if (rc != IDEM_OK)
        pg_failed(r, sl, rc, &e);
    return true;
}

/* Waits until a socket has something for us, or the next deadline. */
static void wait_io(idem_relay_t *r)
{
    struct pollfd pfd[IDEMP_RELAY_INFLIGHT_MAX + 3];
    nfds_t n = 0;
    int ctl_at = -1;
    int64_t now = idemp_now_ms(), wait = 100;
    if (idemp_amqp_connected(r->amqp)) {
        if (idemp_amqp_buffered(r->amqp))
            return; /* frames already read: no need to wait for the socket */
        pfd[n++] = (struct pollfd){idemp_amqp_socket(r->amqp), POLLIN, 0};
    } else {
        int64_t left = idemp_amqp_retry_in_ms(r->amqp);
        wait = left < 50 ? 50 : left < wait ? left : wait;
    }
    for (int k = 0; k < r->nslots; k++)
        if (r->slots[k].phase != SLOT_FREE && idemp_pg_pipeline_sent(r->slots[k].pg))
            pfd[n++] = (struct pollfd){idemp_pg_socket(r->slots[k].pg), POLLIN, 0};
    if (idemp_pg_connected(r->ctl)) {
        ctl_at = (int)n;
        pfd[n++] = (struct pollfd){idemp_pg_socket(r->ctl), POLLIN, 0};
    }
    if (!r->want_claim && r->next_poll_ms - now < wait)
        wait = r->next_poll_ms - now;
    if (r->want_claim && r->pg_wait_until > now && r->pg_wait_until - now < wait)
        wait = r->pg_wait_until - now;
    idemp_relay_gauge_wait(r, pfd, &n, now, &wait);
    int got = poll(pfd, n, (int)(wait < 0 ? 0 : wait));
    if (got > 0 && ctl_at >= 0 && (pfd[ctl_at].revents & (POLLIN | POLLHUP | POLLERR)) &&
        idemp_pg_take_notifies(r->ctl))
        notified(r);
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
        if (rc == IDEM_OK)
            rc = idemp_relay_gauges_new(r);
        if (rc != IDEM_OK)
            return idem_error_set(err, rc, "out of memory");
    }
    /* a one-shot run reports through its exit status and summary, not lifecycle lines */
    idem_log_level life = r->cfg.once ? IDEM_LOG_DEBUG : IDEM_LOG_INFO;
    idem_log(life, LOGC, NULL, "starting%s", r->cfg.once ? " (once)" : "");
    int result = IDEM_OK;
    idemp_relay_wake(r);
    r->next_poll_ms = idemp_now_ms() + r->cfg.poll_interval_ms;
    for (;;) {
        if (r->cfg.reload != NULL && *r->cfg.reload)
            idemp_relay_reload(r);
        if (stopping(r) || r->fail_rc != 0)
            idemp_relay_stopping_told(r);
        bool free_all = idle(r);
        /* a stop: no new claims; what is in flight is finished (confirms, marks, commit) */
        if (free_all && (stopping(r) || r->fail_rc != 0 || (r->cfg.once && !r->want_claim)))
            break;
        if (!stopping(r) && r->fail_rc == 0) {
            int rc = ensure_pg(r, err);
            if (rc == IDEM_OK && (free_all || idemp_amqp_connected(r->amqp)))
                rc = ensure_amqp(r, err);
            if (rc != IDEM_OK && (r->cfg.once || rc == IDEM_ERR_NOT_FOUND)) {
                result = rc;
                break;
            }
        }
        if (r->reopen_amqp && free_all && idemp_amqp_connected(r->amqp)) {
            /* RabbitMQ can go on nacking a channel opened while a quorum queue elected its
             * leader: a nack gets a fresh connection before the next batch */
            r->reopen_amqp = false;
            idemp_amqp_disconnect(r->amqp,
                                  "a publish was nacked; reconnecting for a fresh channel");
            continue;
        }
        bool progress = broker_step(r);
        progress = pg_step(r) || progress;
        progress = claim_step(r) || progress;
        idemp_amqp_flush(r->amqp); /* this turn's publishes go out */
        idemp_relay_gauge_step(r);
        idemp_relay_holder_step(r);
        idemp_relay_wake_step(r, !r->want_claim && free_all);
        idemp_relay_report(r);
        if (!progress)
            wait_io(r);
    }
    idemp_relay_stopping_told(r);
    if (result == IDEM_OK && r->fail_rc != 0) {
        result = r->fail_rc;
        idem_error_set(err, r->fail_rc, "%s", r->fail_err.text);
    }
    if (result != IDEM_OK)
        idemp_relay_salvage(r, IDEM_ERR_AMQP_LOST, err); /* a batch left in flight stays pending */
    {
        char a[24], b[24], c1[24];
        snprintf(a, sizeof a, "%llu", (unsigned long long)r->stats.published);
        snprintf(b, sizeof b, "%llu", (unsigned long long)r->stats.failures);
        snprintf(c1, sizeof c1, "%llu", (unsigned long long)r->stats.parked);
        const char *kv[] = {"published", a, "failures", b, "parked", c1, NULL};
        idem_log(life, LOGC, kv, "stopped");
    }
    idemp_relay_wake_stop(r);
    idemp_amqp_disconnect(r->amqp, NULL);
    for (int i = 0; i < r->nslots; i++)
        idemp_pg_disconnect(r->slots[i].pg, NULL);
    idemp_pg_disconnect(r->ctl, NULL);
    if (r->rows_pg != NULL)
        idemp_pg_disconnect(r->rows_pg, NULL);
    return result;
}
