/* relay_wake.c - when the relay looks for rows, without a NOTIFY for every emitted event.
 *
 * A NOTIFY makes PostgreSQL commit notifying transactions one at a time (a database-wide lock
 * held through the commit's flush), so emitters notify only while some relay says it is idle:
 * idem_emit checks for a row of idem_relay_idle. A relay that found rows in the last QUIET_MS (or
 * was just notified) is busy: it deletes its idle row and polls every 1 to FAST_POLL_MAX_MS
 * milliseconds, the interval doubling while claims find nothing, and not at all while a batch
 * of its own is in flight: that batch's commit wakes the next claim, and a poll meanwhile would
 * walk past the subscriptions its batches hold (in a drain, every one: empty walks every few
 * milliseconds took the CPU the broker needed to confirm, and cut a drain from 6,000 to 2,500/s).
 * Once it has found nothing for QUIET_MS it writes its idle row and claims once more: from then on
 * an emit notifies it, and between NOTIFYs it goes on polling, the interval still doubling up to
 * the backstop (--poll-interval). An emitter that ran idem_emit before the idle row was there (so
 * it did not notify) and commits after that last look is found by one of those polls: a missed
 * wake-up costs about as long again as the emitter's transaction ran on after the relay went idle,
 * and at most one poll interval. A row counts while the session it names (pid and
 * application_name) lives and for 30 s after it was written (sql/021, sql/023): an idle relay
 * writes it again every IDLE_REFRESH_MS, so a row left by a relay killed while idle stops making
 * emitters notify within 30 s even if PostgreSQL gives its pid to a session of the same name.
 *
 * While busy, a poll costs each event at most FAST_POLL_MAX_MS of waiting; QUIET_MS is long
 * enough that a stream of events (even a slow emitter's, an event every few tens of
 * milliseconds) keeps the relay busy, and short enough that a relay that gets an event now and
 * then is woken by its NOTIFY, without a quarter of a second of 4 ms polls after each event. */
#include <stdio.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "relay_int.h"

#define QUIET_MS 250
#define FAST_POLL_MIN_MS 1
#define FAST_POLL_MAX_MS 4
/* well inside the 30 s for which idem_relay_waits() (sql/023) counts a row */
#define IDLE_REFRESH_MS 10000

/* going idle, and again every IDLE_REFRESH_MS while idle: the row's time is the last write */
#define SQL_IDLE                                                                                   \
    "INSERT INTO idem.idem_relay_idle (pid) VALUES (pg_catalog.pg_backend_pid())"                  \
    " ON CONFLICT (pid) DO UPDATE SET since = pg_catalog.now(), app = EXCLUDED.app"
#define SQL_BUSY "DELETE FROM idem.idem_relay_idle WHERE pid = pg_catalog.pg_backend_pid()"
/* Rows whose session is gone: no session has the row's pid and name (the name, the row's
 * default, is its writer's application_name), or it is ours, from a session of ours before. */
#define SQL_GONE                                                                                   \
    "DELETE FROM idem.idem_relay_idle i WHERE NOT EXISTS"                                          \
    " (SELECT 1 FROM pg_catalog.pg_stat_activity a WHERE a.pid = i.pid"                            \
    " AND a.application_name = i.app AND a.pid <> pg_catalog.pg_backend_pid())"

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
    r->busy_until_ms = idemp_now_ms() + QUIET_MS;
    r->fast_poll_ms = FAST_POLL_MIN_MS;
}

void idemp_relay_found_none(idem_relay_t *r)
{
    int64_t cap = idemp_now_ms() < r->busy_until_ms ? FAST_POLL_MAX_MS : r->cfg.poll_interval_ms;
    if (r->fast_poll_ms >= FAST_POLL_MIN_MS && r->fast_poll_ms < cap)
        r->fast_poll_ms *= 2;
}

/* A batch of ours is between its claim and its commit. */
static bool in_flight(const idem_relay_t *r)
{
    for (int k = 0; k < r->nslots; k++)
        if (r->slots[k].phase != SLOT_FREE)
            return true;
    return false;
}

int64_t idemp_relay_poll_every(const idem_relay_t *r)
{
    int64_t every = r->fast_poll_ms;
    /* not connected yet; or a batch of ours is in flight: its commit wakes the next claim, and a
     * poll meanwhile would walk subscriptions our own batches hold (in a drain, every one) */
    if (every < FAST_POLL_MIN_MS || in_flight(r))
        return r->cfg.poll_interval_ms;
    if (idemp_now_ms() < r->busy_until_ms && every > FAST_POLL_MAX_MS)
        every = FAST_POLL_MAX_MS;
    return every < r->cfg.poll_interval_ms ? every : r->cfg.poll_interval_ms;
}

void idemp_relay_wake_stop(idem_relay_t *r)
{
    /* not while a gauge's read is in flight on the connection: the row is then left to the
     * next relay that connects */
    if (r->idle_said && !r->idle_broken && idemp_pg_connected(r->ctl) &&
        !idemp_pg_pipeline_open(r->ctl) && !idemp_pg_pipeline_sent(r->ctl) && say(r, SQL_BUSY))
        r->idle_said = false;
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
            r->idle_written_ms = idemp_now_ms();
            r->want_claim = true; /* the last look, see above */
            r->wakes++;
        }
    } else if (!busy && r->idle_said && idemp_now_ms() - r->idle_written_ms >= IDLE_REFRESH_MS) {
        /* still idle: the row counts for 30 s after it was written */
        if (say(r, SQL_IDLE))
            r->idle_written_ms = idemp_now_ms();
    }
}
