/* relay_claim.c - the relay's claim: whole subscriptions (transaction-level advisory locks), then
 * their rows by primary key with a fresh snapshot, kept only as gapless runs from each
 * subscription's first pending row. Each step is a pipeline sent without waiting; the loop
 * (relay.c) hands its answer to idemp_relay_claim_step. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "relay_int.h"

/* Transaction-local settings (nothing leaks to other clients of a pooled server connection): the
 * relay's commits need not wait for the disk (relay_batch.c says why); the claim's plans do not
 * depend on its parameters, and planning it with a 200-element array costs more than running it;
 * daemons run short statements, which JIT only slows down. */
#define SQL_SETTINGS                                                                               \
    "SELECT set_config('synchronous_commit', 'off', true),"                                        \
    " set_config('plan_cache_mode', 'force_generic_plan', true), set_config('jit', 'off', true),"  \
    " set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)"

/* Step 1: the oldest due rows whose subscription no other relay holds, skipping rows that wait
 * behind a retrying row of their subscription (so they cannot crowd out other subscriptions);
 * taking the subscription's transaction-level advisory lock is what makes a row a candidate. It
 * looks at the oldest $2 such rows only (SCAN_BATCHES batches): when most of them belong to
 * batches in flight, ours or other relays', a claim costs that much and no more, instead of a
 * walk of the whole backlog; rows further back come into view as those batches commit. It
 * returns where each candidate is (its ctid), so that step 2 reads it without an index probe. */
#define SQL_LOCK_CANDIDATES                                                                        \
    "SELECT w.ctid FROM (SELECT o.ctid, o.subscription_id, o.seq FROM event_outbox o"              \
    "                     WHERE o.status = 'pending' AND o.next_attempt_at <= now()"               \
    "                       AND NOT EXISTS (SELECT 1 FROM event_outbox e"                          \
    "                                        WHERE e.subscription_id = o.subscription_id"          \
    "                                          AND e.status = 'pending' AND e.attempts > 0"        \
    "                                          AND e.next_attempt_at > now() AND e.seq < o.seq)"   \
    "                     ORDER BY o.seq LIMIT $2) w"                                              \
    " WHERE pg_try_advisory_xact_lock(7649, hashtext(w.subscription_id::text))"                    \
    " ORDER BY w.seq LIMIT $1"
#define SCAN_BATCHES 16

/* Step 2, with a snapshot taken after the locks are held: the candidates still pending and due,
 * locked. Each row carries the seq of the previous pending row of its subscription for the gap
 * filter, which also leaves out every row behind an earlier row that waits for a retry (that row
 * is pending and not in the batch). The candidates are read by ctid, one LATERAL probe each
 * (OFFSET 0 keeps the planner from turning that into a walk of the whole pending index), so the
 * cost follows the batch, not the backlog; a candidate updated since step 1 has a new ctid, is not
 * found and waits for a later claim (the gap filter holds back its subscription's later rows).
 * Its ctid is returned for the marks: the row lock keeps the row where it is until we commit. The
 * timestamp is the creation time in whole seconds, rounded down. */
#define SQL_CLAIM_ROWS                                                                             \
    "SELECT o.outbox_id, o.event_id, o.subscription_id, o.event_type, o.payload::text,"            \
    "       o.attempts, floor(extract(epoch FROM o.created_at))::bigint, o.seq,"                   \
    "       (SELECT h.seq FROM event_outbox h"                                                     \
    "         WHERE h.subscription_id = o.subscription_id AND h.status = 'pending'"                \
    "           AND h.seq < o.seq ORDER BY h.seq DESC LIMIT 1), o.headers::text, o.row_tid"        \
    "  FROM unnest($1::tid[]) AS c(t)"                                                             \
    "  CROSS JOIN LATERAL (SELECT x.ctid AS row_tid, x.* FROM event_outbox x"                      \
    "                       WHERE x.ctid = c.t AND x.status = 'pending'"                           \
    "                         AND x.next_attempt_at <= now()"                                      \
    "                      OFFSET 0 FOR UPDATE SKIP LOCKED) o"                                     \
    " ORDER BY o.seq"

/* Column numbers of SQL_CLAIM_ROWS. */
enum {
    C_OUTBOX_ID,
    C_EVENT_ID,
    C_SUB,
    C_TYPE,
    C_PAYLOAD,
    C_ATTEMPTS,
    C_CREATED,
    C_SEQ,
    C_PREV,
    C_HDR,
    C_TID
};

static const char *const LOGC = "relay";

/* ---- the gap filter ------------------------------------------------------------------------ */

size_t idemp_relay_gap_filter(const gap_row_t *rows, size_t n, size_t max, bool *keep)
{
    size_t kept = 0;
    for (size_t k = 0; k < n; k++) {
        keep[k] = false;
        if (kept == max)
            continue;
        const char *sub = rows[k].subscription_id, *prev_kept = NULL;
        bool broken = false;
        for (size_t j = 0; j < k; j++)
            if (strcmp(rows[j].subscription_id, sub) == 0) {
                if (keep[j])
                    prev_kept = rows[j].seq;
                else
                    broken = true;
            }
        const char *pp = rows[k].prev_pending_seq;
        bool follows = prev_kept == NULL ? pp == NULL : pp != NULL && strcmp(pp, prev_kept) == 0;
        if (broken || !follows)
            continue;
        keep[k] = true;
        kept++;
    }
    return kept;
}

/* ---- claiming -------------------------------------------------------------------------------- */

/* Fills sl's rows from the claim result, through the gap filter. */
static int load_rows(idem_relay_t *r, slot_t *sl, idemp_rows_t *res, idem_error_t *err)
{
    size_t rows = (size_t)idemp_rows_count(res);
    gap_row_t *g = calloc(rows ? rows : 1, sizeof *g);
    bool *keep = calloc(rows ? rows : 1, sizeof *keep);
    if (g == NULL || keep == NULL) {
        free(g);
        free(keep);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < rows; k++) {
        g[k].subscription_id = idemp_rows_get(res, (int)k, C_SUB);
        g[k].seq = idemp_rows_get(res, (int)k, C_SEQ);
        g[k].prev_pending_seq =
            idemp_rows_isnull(res, (int)k, C_PREV) ? NULL : idemp_rows_get(res, (int)k, C_PREV);
    }
    idemp_relay_gap_filter(g, rows, (size_t)r->cfg.batch, keep);
    size_t n = 0;
    for (size_t k = 0; k < rows; k++) {
        int i = (int)k;
        if (!keep[k]) {
            const char *kv[] = {"subscription_id", g[k].subscription_id, "event_id",
                                idemp_rows_get(res, i, C_EVENT_ID), NULL};
            idem_log(IDEM_LOG_DEBUG, LOGC, kv,
                     "left for a later claim: an earlier pending row of its subscription was "
                     "not claimed");
            continue;
        }
        row_t *row = &sl->rows[n++];
        snprintf(row->outbox_id, sizeof row->outbox_id, "%s", idemp_rows_get(res, i, C_OUTBOX_ID));
        snprintf(row->tid, sizeof row->tid, "%s", idemp_rows_get(res, i, C_TID));
        snprintf(row->event_id, sizeof row->event_id, "%s", idemp_rows_get(res, i, C_EVENT_ID));
        snprintf(row->subscription_id, sizeof row->subscription_id, "%s", g[k].subscription_id);
        row->event_type = idemp_rows_get(res, i, C_TYPE);
        row->payload = idemp_rows_get(res, i, C_PAYLOAD);
        row->headers = idemp_rows_isnull(res, i, C_HDR) ? NULL : idemp_rows_get(res, i, C_HDR);
        row->created_s = strtoll(idemp_rows_get(res, i, C_CREATED), NULL, 10);
        row->seq = strtoll(g[k].seq, NULL, 10);
        row->state = R_UNSENT;
        row->why[0] = '\0';
        row->prev = -1;
        for (size_t j = n - 1; j-- > 0;)
            if (memcmp(sl->rows[j].subscription_id, row->subscription_id, 36) == 0) {
                row->prev = (int)j;
                break;
            }
    }
    free(g);
    free(keep);
    sl->n = n;
    return IDEM_OK;
}

int idemp_relay_claim_start(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    char limit[16], scan[24];
    snprintf(limit, sizeof limit, "%d", r->cfg.batch);
    snprintf(scan, sizeof scan, "%lld", (long long)r->cfg.batch * SCAN_BATCHES);
    sl->t0 = idemp_now_ms();
    sl->n = 0;
    sl->waiting = 0;
    sl->order = ++r->claims;
    /* BEGIN, the settings and step 1 travel together */
    int rc = idemp_pg_pipeline_begin(sl->pg, err);
    if (rc == IDEM_OK)
        rc = idemp_pg_queue_command(sl->pg, "BEGIN", err);
    if (rc == IDEM_OK) {
        const char *p[] = {r->settings[0], r->settings[1]};
        rc = idemp_pg_queue(sl->pg, SQL_SETTINGS, 2, p, false, err);
    }
    if (rc == IDEM_OK) {
        const char *p[] = {limit, scan};
        rc = idemp_pg_queue(sl->pg, SQL_LOCK_CANDIDATES, 2, p, true, err);
    }
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_send(sl->pg, err);
    sl->phase = SLOT_LOCKING; /* from here the transaction is open until commit or rollback */
    return rc;
}

/* Step 2 for the candidates of step 1. */
static int read_rows(slot_t *sl, idemp_rows_t *cands, idem_error_t *err)
{
    idemp_pgarray_t ids;
    idemp_pgarray_init(&ids);
    for (int i = 0; i < idemp_rows_count(cands); i++)
        idemp_pgarray_add(&ids, idemp_rows_get(cands, i, 0));
    const char *p[] = {idemp_pgarray_str(&ids)};
    int rc = p[0] ? idemp_pg_pipeline_begin(sl->pg, err)
                  : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    if (rc == IDEM_OK)
        rc = idemp_pg_queue(sl->pg, SQL_CLAIM_ROWS, 1, p, true, err);
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_send(sl->pg, err);
    idemp_pgarray_free(&ids);
    sl->phase = SLOT_READING;
    return rc;
}

int idemp_relay_claim_step(idem_relay_t *r, slot_t *sl, idemp_rows_t **rows, size_t *claimed,
                           idem_error_t *err)
{
    idemp_rows_t *res = rows[0];
    rows[0] = NULL;
    *claimed = 0;
    if (sl->phase == SLOT_LOCKING) {
        int rc = idemp_rows_count(res) > 0
                     ? read_rows(sl, res, err)
                     : idemp_relay_settle(r, sl, false, err); /* nothing due */
        idemp_rows_free(res);
        return rc;
    }
    sl->t_claim = idemp_now_ms();
    int rc = load_rows(r, sl, res, err);
    if (rc != IDEM_OK) {
        idemp_rows_free(res);
        return rc; /* the caller rolls back */
    }
    sl->res = res;
    *claimed = sl->n;
    if (sl->n == 0)
        return idemp_relay_settle(r, sl, false, err); /* every candidate was taken meanwhile */
    sl->phase = SLOT_PUBLISHING;
    rc = idemp_relay_publish(r, sl, err);
    sl->t_pub = idemp_now_ms();
    return rc;
}
