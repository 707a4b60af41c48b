/* retain.c - deletes sent outbox rows and ledger rows past their windows, in bounded batches.
 *
 * Each DELETE is its own transaction touching at most `batch` rows, so locks are
 * held for one short statement and concurrent consumers/relays barely notice. Rows another
 * transaction holds are skipped (SKIP LOCKED), never waited for. Pending and failed outbox
 * rows are never candidates. A lease keeps runs from overlapping (see RETAIN_TAKE). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/ops.h>

#include "pg.h"

#define DAY_MS (24LL * 3600 * 1000)

/* The single-runner lock is the row 'retain' of idem.idem_leases (sql/016_followups_and_locks.sql),
 * not an advisory lock, which any role that can connect could take and hold to keep retention
 * from ever running. A run writes its backend's pid there in a short transaction of its own (its
 * deletes are many transactions) and clears it at the end; a lease whose backend is gone (or
 * was the previous server's) is free, so a killed run leaves nothing behind. Only idem's owner
 * and idem_operator may write the row. The wait for the row (another run taking or clearing it
 * at that moment) is bounded. Returns the pid written, or no row when another run holds it. */
#define RETAIN_BEGIN "BEGIN"
#define RETAIN_BOUND "SELECT set_config('lock_timeout', '5s', true)"
/* A batch waits for a table lock (someone's LOCK TABLE, a migration) as long as the session's
 * lock_timeout, or 60s when it has none; then the run fails, and the next run goes on. */
#define RETAIN_BATCH_BOUND                                                                         \
    "SELECT set_config('lock_timeout', CASE current_setting('lock_timeout') WHEN '0' THEN '60s' "  \
    "ELSE current_setting('lock_timeout') END, true)"
#define RETAIN_TAKE                                                                                \
    "UPDATE idem.idem_leases l SET pid = pg_backend_pid(), server_start = "                        \
    "pg_postmaster_start_time(), taken_at = now() WHERE l.name = 'retain' AND (l.pid IS NULL OR "  \
    "l.server_start IS DISTINCT FROM pg_postmaster_start_time() OR NOT EXISTS (SELECT 1 FROM "     \
    "pg_stat_activity a WHERE a.pid = l.pid)) RETURNING l.pid::text"
#define RETAIN_RELEASE "UPDATE idem.idem_leases SET pid = NULL WHERE name = 'retain' AND pid = $1"
/* Who holds it: any role can read these columns of pg_stat_activity. */
#define RETAIN_HOLDER                                                                              \
    "SELECT l.pid::text, coalesce(a.usename::text, ''), coalesce(a.application_name, '')"          \
    "  FROM idem.idem_leases l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"                      \
    " WHERE l.name = 'retain' AND l.pid IS NOT NULL"

/* The cutoffs are fixed once per run: rows that age past the window while the run goes on
 * wait for the next run, and the loops are bounded by what existed at the start. Ledger rows are
 * kept one day longer than the dedup window: a consumer takes timestamps up to one day in the
 * future as they are, so a delivery it finds fresh may carry a timestamp up to a day later than
 * its ledger row's consumed_at (contract, "Failure policy (consumer)"). */
#define LEDGER_SKEW_MS "86400000"
#define RETAIN_CUTOFFS                                                                             \
    "SELECT (now() - $1::bigint * interval '1 millisecond')::text, "                               \
    "(now() - ($2::bigint + " LEDGER_SKEW_MS ") * interval '1 millisecond')::text, "               \
    "(now() - $3::bigint * interval '1 millisecond')::text"

/* One bounded batch each, deleted by idem's owner through functions that keep to the rules
 * (sql/017_narrow_rights.sql): only sent outbox rows, each replaced by its key in the record of
 * emitted keys in the same statement (the key must outlive the row, --keys-keep, and idem_emit
 * writes it nowhere else: sql/018_emitted_keys_at_retention.sql); ledger rows at least a day old.
 * Each returns how many rows it deleted. */
#define RETAIN_OUTBOX "SELECT idem.idem_retain_outbox($1::timestamptz, $2::int)"
#define RETAIN_LEDGER "SELECT idem.idem_retain_ledger($1::timestamptz, $2::int)"
#define RETAIN_KEYS "SELECT idem.idem_retain_keys($1::timestamptz, $2::int)"

void idem_retain_config_init(idem_retain_config_t *cfg)
{
    cfg->outbox_keep_ms = 7 * DAY_MS;
    cfg->dedup_window_ms = 30 * DAY_MS;
    cfg->keys_keep_ms = 400 * DAY_MS;
    cfg->batch = 5000;
    cfg->force = false;
    cfg->stop = NULL;
}

/* "30d", "36h", "90m", "45s" or "1500ms": the largest unit that divides ms. */
static void fmt_duration(int64_t ms, char *out, size_t sz)
{
    static const struct {
        int64_t ms;
        const char *unit;
    } units[] = {{DAY_MS, "d"}, {3600 * 1000LL, "h"}, {60 * 1000LL, "m"}, {1000, "s"}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (ms != 0 && ms % units[i].ms == 0) {
            snprintf(out, sz, "%" PRId64 "%s", ms / units[i].ms, units[i].unit);
            return;
        }
    snprintf(out, sz, "%" PRId64 "ms", ms);
}

int idem_retain_check(const idem_retain_config_t *cfg, idem_error_t *err)
{
    if (cfg == NULL)
        return idem_error_set(err, IDEM_ERR_INVALID, "retention: no configuration");
    if (cfg->outbox_keep_ms < 0 || cfg->dedup_window_ms < 0 || cfg->keys_keep_ms < 0)
        return idem_error_set(err, IDEM_ERR_INVALID, "retention windows must not be negative");
    if (cfg->batch < 1)
        return idem_error_set(err, IDEM_ERR_INVALID, "retention batch must be at least 1");
    if (cfg->force)
        return IDEM_OK;
    char dedup[32], keep[32], keys[32];
    fmt_duration(cfg->dedup_window_ms, dedup, sizeof dedup);
    fmt_duration(cfg->outbox_keep_ms, keep, sizeof keep);
    fmt_duration(cfg->keys_keep_ms, keys, sizeof keys);
    /* A ledger row deleted while its event can still be redelivered (or replayed from the
     * outbox) would let that event apply twice. */
    if (cfg->dedup_window_ms < cfg->outbox_keep_ms)
        return idem_error_set(err, IDEM_ERR_REFUSED,
                              "dedup window %s is shorter than the outbox window %s; "
                              "use --force to run anyway",
                              dedup, keep);
    if (cfg->dedup_window_ms < DAY_MS)
        return idem_error_set(err, IDEM_ERR_REFUSED,
                              "dedup window %s is shorter than 1d; use --force to run anyway",
                              dedup);
    /* A key deleted while its event could still apply would let a replayed emit through. */
    if (cfg->keys_keep_ms < cfg->dedup_window_ms)
        return idem_error_set(err, IDEM_ERR_REFUSED,
                              "keys kept %s is shorter than the dedup window %s; "
                              "use --force to run anyway",
                              keys, dedup);
    return IDEM_OK;
}

/* Runs one batch's function repeatedly until it removes fewer than batch rows. */
static int delete_loop(PGconn *conn, const char *sql, const char *cutoff, int batch,
                       volatile sig_atomic_t *stop, int64_t *deleted, int64_t *batches,
                       idem_error_t *err)
{
    char limit[16];
    snprintf(limit, sizeof limit, "%d", batch);
    const char *params[] = {cutoff, limit};
    for (;;) {
        if (stop != NULL && *stop)
            return IDEM_ERR_INTERRUPTED;
        idemp_rows_t *res = NULL;
        int rc = idemp_pgconn_exec(conn, RETAIN_BEGIN, 0, NULL, NULL, err);
        if (rc == IDEM_OK)
            rc = idemp_pgconn_exec(conn, RETAIN_BATCH_BOUND, 0, NULL, NULL, err);
        if (rc == IDEM_OK)
            rc = idemp_pgconn_exec(conn, sql, 2, params, &res, err);
        /* each function's one value: the rows it deleted */
        int64_t n = rc == IDEM_OK ? strtoll(idemp_rows_get(res, 0, 0), NULL, 10) : 0;
        idemp_rows_free(res);
        if (rc == IDEM_OK)
            rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
        if (rc != IDEM_OK) {
            if (idemp_pgconn_ok(conn))
                idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
            return rc;
        }
        if (n > 0) {
            *deleted += n;
            (*batches)++;
        }
        if (n < batch)
            return IDEM_OK;
    }
}

int idem_retain_run(PGconn *conn, const idem_retain_config_t *cfg, idem_retain_result_t *res,
                    idem_error_t *err)
{
    idem_retain_result_t local;
    if (res == NULL)
        res = &local;
    *res = (idem_retain_result_t){0};
    int rc = idem_retain_check(cfg, err);
    if (rc != IDEM_OK)
        return rc;

    idemp_rows_t *r = NULL;
    char pid[16] = "";
    rc = idemp_pgconn_exec(conn, RETAIN_BEGIN, 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, RETAIN_BOUND, 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, RETAIN_TAKE, 0, NULL, &r, err);
    if (rc == IDEM_OK && idemp_rows_count(r) == 1)
        snprintf(pid, sizeof pid, "%s", idemp_rows_get(r, 0, 0));
    idemp_rows_free(r);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
    if (rc != IDEM_OK) {
        if (idemp_pgconn_ok(conn))
            idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
        return rc;
    }
    if (pid[0] == '\0') {
        res->skipped = true;
        /* best effort: the holder may be gone already */
        if (idemp_pgconn_exec(conn, RETAIN_HOLDER, 0, NULL, &r, NULL) == IDEM_OK) {
            if (idemp_rows_count(r) == 1) {
                const char *role = idemp_rows_get(r, 0, 1), *app = idemp_rows_get(r, 0, 2);
                snprintf(res->holder, sizeof res->holder, "pid %s%s%.63s%s%.63s",
                         idemp_rows_get(r, 0, 0), role[0] ? ", role " : "", role,
                         app[0] ? ", application " : "", app);
            }
            idemp_rows_free(r);
        }
        return IDEM_OK;
    }

    char keep[24], window[24], keys[24];
    snprintf(keep, sizeof keep, "%" PRId64, cfg->outbox_keep_ms);
    snprintf(window, sizeof window, "%" PRId64, cfg->dedup_window_ms);
    snprintf(keys, sizeof keys, "%" PRId64, cfg->keys_keep_ms);
    const char *cparams[] = {keep, window, keys};
    rc = idemp_pgconn_exec(conn, RETAIN_CUTOFFS, 3, cparams, &r, err);
    if (rc == IDEM_OK) {
        char *outbox_cutoff = strdup(idemp_rows_get(r, 0, 0));
        char *ledger_cutoff = strdup(idemp_rows_get(r, 0, 1));
        char *keys_cutoff = strdup(idemp_rows_get(r, 0, 2));
        idemp_rows_free(r);
        if (outbox_cutoff == NULL || ledger_cutoff == NULL || keys_cutoff == NULL)
            rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        if (rc == IDEM_OK)
            rc = delete_loop(conn, RETAIN_OUTBOX, outbox_cutoff, cfg->batch, cfg->stop,
                             &res->outbox_deleted, &res->outbox_batches, err);
        if (rc == IDEM_OK)
            rc = delete_loop(conn, RETAIN_LEDGER, ledger_cutoff, cfg->batch, cfg->stop,
                             &res->ledger_deleted, &res->ledger_batches, err);
        if (rc == IDEM_OK)
            rc = delete_loop(conn, RETAIN_KEYS, keys_cutoff, cfg->batch, cfg->stop,
                             &res->keys_deleted, &res->keys_batches, err);
        free(outbox_cutoff);
        free(ledger_cutoff);
        free(keys_cutoff);
    }
    if (rc == IDEM_ERR_INTERRUPTED)
        idem_error_set(err, rc, "retention stopped between batches by a signal");
    /* A lost connection's backend is gone, and its lease free with it; otherwise clear it now so
     * a caller reusing the connection does not keep other runs out. */
    if (idemp_pgconn_ok(conn)) {
        const char *p[] = {pid};
        idemp_pgconn_exec(conn, RETAIN_RELEASE, 1, p, NULL, NULL);
    }
    return rc;
}
