/* replay.c - returns failed outbox rows to pending, all or nothing, in one transaction.
 *
 * idem_replay locks the failed rows, checks their age and updates them in one statement; if any
 * row is older than the dedup window it changes nothing and the transaction is rolled back, so no
 * row can slip between a check and the update. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/ops.h>

#include "pg.h"

/* $1 = dedup window in ms; $2 = event id (the single-row form). idem_replay
 * (sql/017_narrow_rights.sql) changes the rows, as their owner: only failed rows, and none if one
 * of them is too old by the consumers' own stale rule (idem_stale_before,
 * sql/008_claim_guard.sql) applied to the timestamp the relay will give it (created_at in whole
 * seconds, rounded down). It wakes the relays at COMMIT. */
#define REPLAY_ONE "SELECT stale, created FROM idem.idem_replay($2::uuid, $1::bigint)"
#define REPLAY_ALL "SELECT stale, created FROM idem.idem_replay(NULL, $1::bigint)"
#define REPLAY_STATUS_OF "SELECT status FROM idem.event_outbox WHERE event_id = $1::uuid"

#define DAY_MS (24LL * 3600 * 1000)

static void fmt_window(int64_t ms, char *out, size_t sz)
{
    if (ms % DAY_MS == 0)
        snprintf(out, sz, "%" PRId64 "d", (int64_t)(ms / DAY_MS));
    else if (ms % 3600000 == 0)
        snprintf(out, sz, "%" PRId64 "h", ms / 3600000);
    else if (ms % 60000 == 0)
        snprintf(out, sz, "%" PRId64 "m", ms / 60000);
    else if (ms % 1000 == 0)
        snprintf(out, sz, "%" PRId64 "s", ms / 1000);
    else
        snprintf(out, sz, "%" PRId64 "ms", ms);
}

/* Why event_id is not a failed row, for the error text; runs inside the (doomed) transaction. */
static int not_failed(PGconn *conn, const char *event_id, idem_error_t *err)
{
    idemp_rows_t *r;
    const char *p[] = {event_id};
    int rc = idemp_pgconn_exec(conn, REPLAY_STATUS_OF, 1, p, &r, err);
    if (rc != IDEM_OK)
        return rc;
    if (idemp_rows_count(r) == 0)
        rc = idem_error_set(err, IDEM_ERR_NOT_FOUND, "event %s is not in the outbox", event_id);
    else
        rc = idem_error_set(err, IDEM_ERR_NOT_FOUND,
                            "event %s is %s, not failed; only failed rows are replayed", event_id,
                            idemp_rows_get(r, 0, 0));
    idemp_rows_free(r);
    return rc;
}

static int replay(PGconn *conn, const char *event_id, int64_t dedup_window_ms, int *replayed,
                  idem_error_t *err)
{
    if (replayed != NULL)
        *replayed = 0;
    if (dedup_window_ms < 0)
        return idem_error_set(err, IDEM_ERR_INVALID, "replay: negative dedup window");
    char window[24];
    snprintf(window, sizeof window, "%" PRId64, dedup_window_ms);
    const char *params[] = {window, event_id};

    int rc = idemp_pgconn_exec(conn, "BEGIN", 0, NULL, NULL, err);
    if (rc != IDEM_OK)
        return rc;
    idemp_rows_t *r = NULL;
    rc = idemp_pgconn_exec(conn, event_id ? REPLAY_ONE : REPLAY_ALL, event_id ? 2 : 1, params, &r,
                           err);
    if (rc == IDEM_ERR_PG_QUERY && strcmp(err->sqlstate, "22P02") == 0) {
        /* let PostgreSQL be the judge of uuid syntax; report it as a bad argument */
        err->code = IDEM_ERR_INVALID;
        rc = IDEM_ERR_INVALID;
    }
    int n = 0, too_old = 0;
    const char *oldest = NULL;
    if (rc == IDEM_OK) {
        n = idemp_rows_count(r);
        for (int i = 0; i < n; i++)
            if (idemp_rows_get(r, i, 0)[0] == 't') {
                const char *created = idemp_rows_get(r, i, 1);
                if (oldest == NULL || strcmp(created, oldest) < 0)
                    oldest = created;
                too_old++;
            }
        if (event_id != NULL && n == 0)
            rc = not_failed(conn, event_id, err);
    }
    if (rc == IDEM_OK && too_old > 0) {
        char w[32];
        fmt_window(dedup_window_ms, w, sizeof w);
        if (event_id != NULL)
            rc = idem_error_set(err, IDEM_ERR_REFUSED,
                                "refusing to replay %s: created %s, older than the dedup window "
                                "%s (consumers would dead-letter it as stale)",
                                event_id, oldest, w);
        else
            rc = idem_error_set(err, IDEM_ERR_REFUSED,
                                "refusing to replay: %d of %d failed rows are older than the "
                                "dedup window %s (oldest created %s; consumers would dead-letter "
                                "them as stale); nothing changed",
                                too_old, n, w, oldest);
    }
    idemp_rows_free(r);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
    else if (idemp_pgconn_ok(conn))
        idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
    if (rc == IDEM_OK && replayed != NULL)
        *replayed = n;
    return rc;
}

int idem_replay(PGconn *conn, const char *event_id, int64_t dedup_window_ms, int *replayed,
                idem_error_t *err)
{
    idem_error_t e = {0}; /* own object: the uuid check above reads its sqlstate */
    int rc = replay(conn, event_id, dedup_window_ms, replayed, &e);
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    return rc;
}
