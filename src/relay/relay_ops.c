/* relay_ops.c - the relay as operators see it: the gauges (the oldest pending row's age, the
 * counts of pending and failed rows), its health (/healthz and systemd's STATUS=), readiness and
 * stopping told to systemd, a reload (SIGHUP).
 *
 * The gauges are read without blocking the loop: a read is a pipeline (its own short transaction
 * with a lock and a statement timeout) sent on its connection and answered in a later turn, so
 * the claims, publishes and commits of the batches in flight never wait for it. The age is read
 * on the control connection every second (one probe of the pending index). The counts are read on
 * a connection of their own, so that a long count never delays the age: index-only scans of the
 * partial indexes of pending and failed rows, whose cost grows with the backlog; a count starts
 * no sooner than GAUGE_ROWS_SHARE times the last one's duration after it started (at least a
 * second, at most GAUGE_ROWS_MAX_MS), so however large the outbox, counting keeps one backend
 * busy 1/GAUGE_ROWS_SHARE of the time at most. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "notify.h"
#include "relay_int.h"

#define GAUGE_EVERY_MS 1000
#define GAUGE_ROWS_SHARE 20
#define GAUGE_ROWS_MAX_MS 60000

#define SQL_OLDEST_PENDING                                                                         \
    "SELECT extract(epoch FROM clock_timestamp() - created_at) FROM idem.event_outbox"             \
    " WHERE status = 'pending' ORDER BY created_at LIMIT 1"
#define SQL_OUTBOX_ROWS                                                                            \
    "SELECT (SELECT count(*) FROM idem.event_outbox WHERE status = 'pending'),"                    \
    " (SELECT count(*) FROM idem.event_outbox WHERE status = 'failed')"
/* A gauge's read waits for a lock this long at most (transaction-local): behind a queued lock
 * request on the outbox (a migration's ALTER TABLE) it would otherwise hold up the control
 * connection, and the request waits for our batches in flight. */
#define SQL_GAUGE_SETTINGS                                                                         \
    "SELECT set_config('lock_timeout', '100', true),"                                              \
    " set_config('statement_timeout', '1000', true)"
/* The counts: one backend, no parallel workers (they would take the cores the claims need). */
#define SQL_ROWS_SETTINGS                                                                          \
    "SELECT set_config('lock_timeout', '100', true),"                                              \
    " set_config('statement_timeout', '30000', true),"                                             \
    " set_config('max_parallel_workers_per_gather', '0', true)"

/* Who blocks a batch's statement: the sessions pg_blocking_pids names (holders of a conflicting
 * lock, or requests queued before ours), with what any role may read of them. A statement that
 * has waited half its lock_timeout (at most HOLDER_PROBE_MS) is asked about once. */
#define HOLDER_PROBE_MS 1000
#define SQL_HOLDERS                                                                                \
    "SELECT a.pid::text, coalesce(a.usename::text, ''), coalesce(a.application_name, '')"          \
    "  FROM pg_catalog.pg_stat_activity a"                                                         \
    " WHERE a.pid = ANY (pg_catalog.pg_blocking_pids($1::integer)) ORDER BY a.pid LIMIT 4"

/* After this many failed statements in a row the relay counts as paused (a single lock timeout
 * is not a pause). */
#define PAUSED_AFTER_FAILURES 3

static const char *const LOGC = "relay";

enum { GAUGE_OLDEST, GAUGE_ROWS };

int idemp_relay_gauges_new(idem_relay_t *r)
{
    r->rows_pg = idemp_pg_new(r->pg_conninfo, LOGC);
    if (r->rows_pg == NULL)
        return IDEM_ERR_NOMEM;
    idemp_pg_set_backoff(r->rows_pg, 200, 5000);
    r->gauges[GAUGE_OLDEST] = (gauge_read_t){r->ctl, false, 0, 0};
    r->gauges[GAUGE_ROWS] = (gauge_read_t){r->rows_pg, false, 0, 0};
    return IDEM_OK;
}

static int send_read(idemp_pg_t *pg, const char *settings, const char *sql, idem_error_t *e)
{
    int rc = idemp_pg_pipeline_begin(pg, e);
    if (rc == IDEM_OK)
        rc = idemp_pg_queue_command(pg, "BEGIN", e);
    if (rc == IDEM_OK)
        rc = idemp_pg_queue(pg, settings, 0, NULL, false, e);
    if (rc == IDEM_OK)
        rc = idemp_pg_queue(pg, sql, 0, NULL, true, e);
    if (rc == IDEM_OK)
        rc = idemp_pg_queue_commit(pg, e);
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_send(pg, e);
    return rc;
}

/* The gauge keeps its last value; it is read again in a second. */
static void not_read(gauge_read_t *g, const idem_error_t *e, int64_t now)
{
    idemp_pg_rollback(g->pg);
    g->next_ms = now + GAUGE_EVERY_MS;
    const char *kv[] = {"server", "postgres", NULL};
    idem_log(IDEM_LOG_DEBUG, LOGC, kv, "gauge not read: %s", e->text);
}

/* g's read in flight: its answer, if it has come. */
static void take(idem_relay_t *r, int which)
{
    gauge_read_t *g = &r->gauges[which];
    bool done = false;
    idemp_rows_t *res = NULL;
    idem_error_t e = {0};
    int rc = idemp_pg_pipeline_poll(g->pg, &done, &res, 1, &e);
    if (!done)
        return;
    g->inflight = false;
    int64_t now = idemp_now_ms();
    if (rc != IDEM_OK) {
        not_read(g, &e, now);
        return;
    }
    if (which == GAUGE_OLDEST) {
        idemp_metrics_oldest_pending(
            r->metrics, idemp_rows_count(res) > 0 ? strtod(idemp_rows_get(res, 0, 0), NULL) : 0.0);
        /* a NOTIFY read along with the answer is in libpq's queue: the socket will not say so */
        if (idemp_pg_take_notifies(r->ctl)) {
            idemp_relay_busy(r);
            idemp_relay_wake(r);
        }
    } else if (idemp_rows_count(res) == 1) {
        idemp_metrics_outbox_rows(r->metrics, strtoll(idemp_rows_get(res, 0, 0), NULL, 10),
                                  strtoll(idemp_rows_get(res, 0, 1), NULL, 10));
        int64_t next = (now - g->t0) * GAUGE_ROWS_SHARE;
        next = next < GAUGE_EVERY_MS      ? GAUGE_EVERY_MS
               : next > GAUGE_ROWS_MAX_MS ? GAUGE_ROWS_MAX_MS
                                          : next;
        g->next_ms = g->t0 + next;
    }
    idemp_rows_free(res);
}

void idemp_relay_gauge_step(idem_relay_t *r)
{
    if (r->metrics == NULL)
        return;
    /* the control connection is made by the loop (it also LISTENs); the counts' one here */
    if (!idemp_pg_connected(r->rows_pg))
        idemp_pg_ensure(r->rows_pg, NULL, NULL);
    for (int which = GAUGE_OLDEST; which <= GAUGE_ROWS; which++) {
        gauge_read_t *g = &r->gauges[which];
        if (!idemp_pg_connected(g->pg)) {
            g->inflight = false;
            continue;
        }
        if (g->inflight)
            take(r, which);
        int64_t now = idemp_now_ms();
        if (g->inflight || now < g->next_ms)
            continue;
        idem_error_t e = {0};
        int rc = which == GAUGE_OLDEST
                     ? send_read(g->pg, SQL_GAUGE_SETTINGS, SQL_OLDEST_PENDING, &e)
                     : send_read(g->pg, SQL_ROWS_SETTINGS, SQL_OUTBOX_ROWS, &e);
        if (rc != IDEM_OK) {
            not_read(g, &e, now);
            continue;
        }
        g->inflight = true;
        g->t0 = now;
        if (which == GAUGE_OLDEST)
            g->next_ms = now + GAUGE_EVERY_MS;
    }
}

void idemp_relay_gauge_wait(const idem_relay_t *r, struct pollfd *pfd, nfds_t *n, int64_t now,
                            int64_t *wait)
{
    if (r->metrics == NULL)
        return;
    for (int which = GAUGE_OLDEST; which <= GAUGE_ROWS; which++) {
        const gauge_read_t *g = &r->gauges[which];
        if (!idemp_pg_connected(g->pg)) {
            if (which == GAUGE_ROWS && idemp_pg_retry_in_ms(g->pg) < *wait)
                *wait = idemp_pg_retry_in_ms(g->pg);
            continue;
        }
        if (g->inflight) {
            if (g->pg != r->ctl)
                pfd[(*n)++] = (struct pollfd){idemp_pg_socket(g->pg), POLLIN, 0};
        } else if (g->next_ms - now < *wait) {
            *wait = g->next_ms - now;
        }
    }
}

/* ---- who holds a lock a batch waits for ------------------------------------------------ */

void idemp_relay_sent(slot_t *sl)
{
    sl->t_sent = idemp_now_ms();
    sl->probed = false;
}

/* A connection free for a short statement of its own: the control connection, else a free
 * slot's. */
static idemp_pg_t *probe_conn(idem_relay_t *r)
{
    if (idemp_pg_connected(r->ctl) && !idemp_pg_pipeline_open(r->ctl) &&
        !idemp_pg_pipeline_sent(r->ctl))
        return r->ctl;
    for (int k = 0; k < r->nslots; k++) {
        idemp_pg_t *pg = r->slots[k].pg;
        if (r->slots[k].phase == SLOT_FREE && idemp_pg_connected(pg) &&
            !idemp_pg_pipeline_open(pg) && !idemp_pg_pipeline_sent(pg))
            return pg;
    }
    return NULL;
}

/* sl's holders as "pid N (role R, application A); ...", or "" when nothing blocks it. */
static void ask_holders(idem_relay_t *r, idemp_pg_t *pg, slot_t *sl)
{
    char pid[16];
    snprintf(pid, sizeof pid, "%d", idemp_pg_backend_pid(sl->pg));
    const char *p[] = {pid};
    idemp_rows_t *res = NULL;
    idem_error_t e = {0};
    sl->holder[0] = '\0';
    if (idemp_pg_exec(pg, SQL_HOLDERS, 1, p, &res, &e) != IDEM_OK) {
        const char *kv[] = {"server", "postgres", NULL};
        idem_log(IDEM_LOG_DEBUG, LOGC, kv, "holders of a lock not read: %s", e.text);
        return;
    }
    size_t len = 0;
    for (int i = 0; i < idemp_rows_count(res) && len < sizeof sl->holder; i++) {
        const char *role = idemp_rows_get(res, i, 1), *app = idemp_rows_get(res, i, 2);
        int w = snprintf(sl->holder + len, sizeof sl->holder - len, "%spid %s (role %.40s%s%.40s)",
                         i > 0 ? "; " : "", idemp_rows_get(res, i, 0), role[0] ? role : "?",
                         app[0] ? ", application " : "", app);
        if (w < 0)
            break;
        len += (size_t)w;
    }
    idemp_rows_free(res);
    /* a NOTIFY read along with the answer is in libpq's queue: the socket will not say so */
    if (pg == r->ctl && idemp_pg_take_notifies(r->ctl)) {
        idemp_relay_busy(r);
        idemp_relay_wake(r);
    }
}

void idemp_relay_holder_step(idem_relay_t *r)
{
    int64_t now = idemp_now_ms(), half = r->cfg.lock_timeout_ms / 2;
    int64_t after = half > 0 && half < HOLDER_PROBE_MS ? half : HOLDER_PROBE_MS;
    for (int k = 0; k < r->nslots; k++) {
        slot_t *sl = &r->slots[k];
        if ((sl->phase != SLOT_LOCKING && sl->phase != SLOT_READING &&
             sl->phase != SLOT_SETTLING) ||
            sl->probed || !idemp_pg_pipeline_sent(sl->pg) || now - sl->t_sent < after)
            continue;
        idemp_pg_t *pg = probe_conn(r);
        if (pg == NULL)
            return;
        sl->probed = true;
        ask_holders(r, pg, sl);
        if (sl->holder[0] != '\0' && r->cfg.lock_timeout_ms == 0) {
            const char *kv[] = {"server", "postgres", NULL};
            idem_log(IDEM_LOG_WARN, LOGC, kv, "a batch waits for a lock held by %s", sl->holder);
        }
    }
}

/* ---- health, systemd, reload ------------------------------------------------------------ */

void idemp_relay_report(idem_relay_t *r)
{
    bool pg_up = false;
    for (int k = 0; k < r->nslots; k++)
        pg_up = pg_up || idemp_pg_connected(r->slots[k].pg);
    if (!r->cfg.once)
        pg_up = pg_up && idemp_pg_connected(r->ctl);
    bool amqp_up = idemp_amqp_connected(r->amqp);
    const char *paused = r->pg_failures >= PAUSED_AFTER_FAILURES ? r->pg_failed_state : "";
    idemp_metrics_health(r->metrics, pg_up, amqp_up, paused);
    if (!r->cfg.sd_notify || r->cfg.once || r->stopping_told)
        return;
    char line[64];
    int code = idemp_health_line(pg_up, amqp_up, paused, line, sizeof line);
    line[strcspn(line, "\n")] = '\0';
    const char *status = code == 200 ? "publishing" : line;
    idemp_notify_status(&r->ready, r->told, sizeof r->told, code == 200 && r->claimed_once, status);
}

void idemp_relay_stopping_told(idem_relay_t *r)
{
    if (r->stopping_told)
        return;
    r->stopping_told = true;
    if (r->cfg.sd_notify && !r->cfg.once)
        idemp_notify("STOPPING=1\nSTATUS=stopping");
}

void idemp_relay_reload(idem_relay_t *r)
{
    *r->cfg.reload = 0;
    bool tell = r->cfg.sd_notify && !r->cfg.once;
    if (tell)
        idemp_notify("RELOADING=1");
    const char *pw_state = idemp_amqp_reload_password(&r->amqp, 1, r->cfg.reload_password,
                                                      r->cfg.reload_userdata, LOGC);
    /* the log is stderr: whoever holds its other end (journald, a shell's redirection) reopens */
    const char *kv[] = {"password_file", pw_state, NULL};
    idem_log(IDEM_LOG_INFO, LOGC, kv, "reloaded");
    if (tell)
        idemp_notify(r->ready ? "READY=1" : "STATUS=reloaded, not ready yet");
}
