/* relay_wake.c - when the relay looks for rows, without a NOTIFY for every emitted event.
 *
 * A NOTIFY makes PostgreSQL commit notifying transactions one at a time (a database-wide lock
 * held through the commit's flush), so emitters notify only while some relay says it is idle:
 * idem_emit checks for a row of idem_relay_idle. A relay that found rows lately (or was just
 * notified) is busy: it deletes its idle row and polls every few milliseconds, the interval
 * doubling while claims find nothing, until it has found nothing for BUSY_MS; then it writes its
 * idle row and claims once more, and from then on waits for a NOTIFY or the backstop poll
 * (--poll-interval). An emitter that ran idem_emit before the idle row was there and commits after
 * that last claim is found by the backstop poll: a missed wake-up costs at most one poll
 * interval. Stale rows (a relay killed while idle) only make emitters notify, as before. */
#include <stdio.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "relay_int.h"

#define BUSY_MS 1000
#define FAST_POLL_MIN_MS 1
#define FAST_POLL_MAX_MS 16

#define SQL_IDLE                                                                                   \
    "INSERT INTO idem.idem_relay_idle (pid) VALUES (pg_catalog.pg_backend_pid()) ON CONFLICT "     \
    "(pid) DO NOTHING"
#define SQL_BUSY "DELETE FROM idem.idem_relay_idle WHERE pid = pg_catalog.pg_backend_pid()"
#define SQL_GONE                                                                                   \
    "DELETE FROM idem.idem_relay_idle i WHERE NOT EXISTS"                                          \
    " (SELECT 1 FROM pg_catalog.pg_stat_activity a WHERE a.pid = i.pid AND a.pid <> "              \
    "pg_catalog.pg_backend_pid())"

static const char *const LOGC = "relay";

static bool say(idem_relay_t *r, const char *sql)
{
    idem_error_t e = {0};
    if (idemp_pg_exec(r->ctl, sql, 0, NULL, NULL, &e) == IDEM_OK)
        return true;
    /* an older schema without the table (class 42): emitters notify every time, as they did;
     * anything else is tried again at the next change */
    r->idle_broken = strncmp(e.sqlstate, "42", 2) == 0;
    const char *kv[] = {"server", "postgres", NULL};
    idem_log(IDEM_LOG_DEBUG, LOGC, kv, "idle row not written: %s", e.text);
    return false;
}

/* Rows are probably due (a NOTIFY, the backstop poll, a batch's subscriptions let go): claim when
 * a slot is free. A claim that finds less than a batch clears this, unless a wake came since it
 * started. */
void idemp_relay_wake(idem_relay_t *r)
{
    r->wakes++;
    r->want_claim = true;
}

void idemp_relay_wake_connected(idem_relay_t *r)
{
    r->idle_said = false;
    r->idle_broken = false;
    say(r, SQL_GONE);
    idemp_relay_busy(r);
}

void idemp_relay_busy(idem_relay_t *r)
{
    r->busy_until_ms = idemp_now_ms() + BUSY_MS;
    r->fast_poll_ms = FAST_POLL_MIN_MS;
}

void idemp_relay_found_none(idem_relay_t *r)
{
    if (r->fast_poll_ms < FAST_POLL_MAX_MS)
        r->fast_poll_ms *= 2;
}

int64_t idemp_relay_poll_every(const idem_relay_t *r)
{
    if (idemp_now_ms() < r->busy_until_ms && r->fast_poll_ms < r->cfg.poll_interval_ms)
        return r->fast_poll_ms;
    return r->cfg.poll_interval_ms;
}

void idemp_relay_wake_step(idem_relay_t *r, bool quiet)
{
    if (r->cfg.once || r->idle_broken || !idemp_pg_connected(r->ctl) ||
        idemp_pg_pipeline_open(r->ctl))
        return;
    bool busy = idemp_now_ms() < r->busy_until_ms;
    if (busy && r->idle_said) {
        if (say(r, SQL_BUSY))
            r->idle_said = false;
    } else if (!busy && !r->idle_said && quiet) {
        if (say(r, SQL_IDLE)) {
            r->idle_said = true;
            r->want_claim = true; /* the last look, see above */
            r->wakes++;
        }
    }
}
