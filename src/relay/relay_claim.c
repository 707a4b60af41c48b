/* relay_claim.c - the relay's claim: whole subscriptions, by locking each one's first pending row
 * (its head), then their rows in seq order with a fresh snapshot, kept only as gapless runs from
 * each subscription's head. Each step is a pipeline sent without waiting; the loop (relay.c) hands
 * its answer to idemp_relay_claim_step. Before the first claim: is the database migrated to what
 * the relay needs? */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "relay_int.h"

/* Transaction-local settings (nothing leaks to other clients of a pooled server connection): the
 * relay's commits need not wait for the disk (relay_batch.c says why); the claim's plans do not
 * depend on its parameters, and planning it with a 200-element array costs more than running it;
 * daemons run short statements, which JIT only slows down. No sorts: each probe of the claim must
 * walk the index on (subscription_id, seq) in its order. Planned from statistics taken while the
 * outbox had next to nothing pending (the usual state, until a broker outage or a burst), the
 * cheapest-looking plan reads every pending row through the index on seq and sorts them, in each
 * of a claim's 200 probes: 2.9 s a claim with 30,000 pending, against 9 ms. */
#define SQL_SETTINGS                                                                               \
    "SELECT set_config('synchronous_commit', 'off', true),"                                        \
    " set_config('plan_cache_mode', 'force_generic_plan', true), set_config('jit', 'off', true),"  \
    " set_config('enable_sort', 'off', true),"                                                     \
    " set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)"

/* Step 1: up to $1 subscriptions, each by its head (its first pending row): the subscriptions with
 * pending rows are walked in subscription order from the cursor $2 (where this relay's previous
 * claim stopped) round to it again, one index descent each (h), so a subscription costs one probe
 * however long its backlog. A head that waits for a retry is passed over as it is; a due one is
 * locked FOR UPDATE SKIP LOCKED, so a head another relay holds (in a batch in flight, or on a relay
 * that hangs) is passed over at once. Holding a subscription's head is holding the subscription:
 * a relay claims a subscription's rows only from its head (step 2), and seq order is commit order
 * per subscription (idem_emit), so no row before a head we lock can be pending and nobody else
 * holds a row of it. A head changed since the walk's snapshot (sent, or waiting for a retry) fails
 * the lock's recheck and is passed over too. The walk is lazy: it goes on only until $1 heads are
 * locked. Each head comes whole, in walk order, with no previous pending row (the gap filter's
 * column), and where it is (its ctid) for the marks: the row lock keeps it there until we commit.
 * The timestamp is the creation time in whole seconds, rounded down. */
#define SQL_LOCK_HEADS                                                                             \
    "WITH RECURSIVE h(sub, seq, t, due, wrapped) AS ("                                             \
    "    SELECT $2::uuid, 0::bigint, NULL::tid, false, false"                                      \
    "  UNION ALL"                                                                                  \
    "    SELECT n.* FROM h CROSS JOIN LATERAL ("                                                   \
    "        (SELECT o.subscription_id, o.seq, o.ctid, o.next_attempt_at <= now(), h.wrapped"      \
    "           FROM idem.event_outbox o WHERE o.status = 'pending' AND o.subscription_id > h.sub" \
    "          ORDER BY o.subscription_id, o.seq LIMIT 1)"                                         \
    "        UNION ALL"                                                                            \
    "        (SELECT o.subscription_id, o.seq, o.ctid, o.next_attempt_at <= now(), true"           \
    "           FROM idem.event_outbox o WHERE o.status = 'pending' AND NOT h.wrapped"             \
    "          ORDER BY o.subscription_id, o.seq LIMIT 1)"                                         \
    "        LIMIT 1) n(sub, seq, t, due, wrapped)"                                                \
    "     WHERE NOT n.wrapped OR n.sub <= $2::uuid)"                                               \
    "SELECT o.outbox_id, o.event_id, o.subscription_id, o.event_type, o.payload::text,"            \
    "       o.attempts, floor(extract(epoch FROM o.created_at))::bigint, o.seq, NULL::bigint,"     \
    "       o.headers::text, o.row_tid"                                                            \
    "  FROM h CROSS JOIN LATERAL (SELECT x.ctid AS row_tid, x.* FROM idem.event_outbox x"          \
    "                              WHERE x.ctid = h.t AND x.status = 'pending'"                    \
    "                                AND x.next_attempt_at <= now()"                               \
    "                             OFFSET 0 FOR UPDATE SKIP LOCKED) o"                              \
    " WHERE h.due LIMIT $1"

/* Step 2, when step 1 locked at most half a batch of heads, with a snapshot taken after they are
 * locked: up to $3 more pending due rows of each subscription after its head $2, in seq order,
 * locked (nobody else holds them: we hold the head), so that the batch is shared out between its
 * subscriptions. Each row carries the seq of the previous pending row of its subscription for the
 * gap filter, which leaves out every row behind an earlier row that is not in the batch (one that
 * waits for a retry). The other columns are step 1's. */
#define SQL_CLAIM_ROWS                                                                             \
    "SELECT o.outbox_id, o.event_id, o.subscription_id, o.event_type, o.payload::text,"            \
    "       o.attempts, floor(extract(epoch FROM o.created_at))::bigint, o.seq,"                   \
    "       (SELECT p.seq FROM idem.event_outbox p"                                                \
    "         WHERE p.subscription_id = o.subscription_id AND p.status = 'pending'"                \
    "           AND p.seq < o.seq ORDER BY p.seq DESC LIMIT 1), o.headers::text, o.row_tid"        \
    "  FROM unnest($1::uuid[], $2::bigint[]) AS h(sub, seq)"                                       \
    "  CROSS JOIN LATERAL (SELECT x.ctid AS row_tid, x.* FROM idem.event_outbox x"                 \
    "                       WHERE x.subscription_id = h.sub AND x.status = 'pending'"              \
    "                         AND x.seq > h.seq AND x.next_attempt_at <= now()"                    \
    "                      ORDER BY x.seq LIMIT $3 FOR UPDATE SKIP LOCKED) o"                      \
    " ORDER BY o.seq"

/* Column numbers of SQL_LOCK_HEADS and SQL_CLAIM_ROWS. */
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

/* One row of a claim's results. */
typedef struct ref {
    idemp_rows_t *res;
    int i;
    int64_t seq;
} ref_t;

static int by_seq(const void *a, const void *b)
{
    int64_t x = ((const ref_t *)a)->seq, y = ((const ref_t *)b)->seq;
    return (x > y) - (x < y);
}

/* Fills sl's rows from the heads of step 1 and the rows of step 2 (NULL: none), in seq order,
 * through the gap filter. */
static int load_rows(idem_relay_t *r, slot_t *sl, idemp_rows_t *heads, idemp_rows_t *more,
                     idem_error_t *err)
{
    size_t nh = (size_t)idemp_rows_count(heads), rows = nh + (size_t)idemp_rows_count(more);
    ref_t *ref = calloc(rows ? rows : 1, sizeof *ref);
    gap_row_t *g = calloc(rows ? rows : 1, sizeof *g);
    bool *keep = calloc(rows ? rows : 1, sizeof *keep);
    if (ref == NULL || g == NULL || keep == NULL) {
        free(ref);
        free(g);
        free(keep);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < rows; k++) {
        ref[k].res = k < nh ? heads : more;
        ref[k].i = (int)(k < nh ? k : k - nh);
        ref[k].seq = strtoll(idemp_rows_get(ref[k].res, ref[k].i, C_SEQ), NULL, 10);
    }
    qsort(ref, rows, sizeof *ref, by_seq);
    for (size_t k = 0; k < rows; k++) {
        idemp_rows_t *res = ref[k].res;
        int i = ref[k].i;
        g[k].subscription_id = idemp_rows_get(res, i, C_SUB);
        g[k].seq = idemp_rows_get(res, i, C_SEQ);
        g[k].prev_pending_seq =
            idemp_rows_isnull(res, i, C_PREV) ? NULL : idemp_rows_get(res, i, C_PREV);
    }
    idemp_relay_gap_filter(g, rows, (size_t)r->cfg.batch, keep);
    size_t n = 0;
    for (size_t k = 0; k < rows; k++) {
        idemp_rows_t *res = ref[k].res;
        int i = ref[k].i;
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
        row->seq = ref[k].seq;
        row->state = R_UNSENT;
        row->why[0] = '\0';
        row->prev = -1;
        for (size_t j = n - 1; j-- > 0;)
            if (memcmp(sl->rows[j].subscription_id, row->subscription_id, 36) == 0) {
                row->prev = (int)j;
                break;
            }
    }
    free(ref);
    free(g);
    free(keep);
    sl->n = n;
    return IDEM_OK;
}

int idemp_relay_claim_start(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    char limit[16];
    snprintf(limit, sizeof limit, "%d", r->cfg.batch);
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
        const char *p[] = {limit, r->cursor};
        rc = idemp_pg_queue(sl->pg, SQL_LOCK_HEADS, 2, p, true, err);
    }
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_send(sl->pg, err);
    sl->phase = SLOT_LOCKING; /* from here the transaction is open until commit or rollback */
    sl->holder[0] = '\0';
    idemp_relay_sent(sl);
    return rc;
}

/* Rows step 2 reads after each of nheads heads: the rest of a batch, shared out evenly (so that
 * no head falls out of the batch). */
static int rows_per_head(const idem_relay_t *r, int nheads)
{
    return (r->cfg.batch - nheads) / nheads;
}

/* Step 2 after the heads of step 1. */
static int read_rows(idem_relay_t *r, slot_t *sl, idemp_rows_t *heads, idem_error_t *err)
{
    int nheads = idemp_rows_count(heads);
    char per[16];
    snprintf(per, sizeof per, "%d", rows_per_head(r, nheads));
    idemp_pgarray_t subs, seqs;
    idemp_pgarray_init(&subs);
    idemp_pgarray_init(&seqs);
    for (int i = 0; i < nheads; i++) {
        idemp_pgarray_add(&subs, idemp_rows_get(heads, i, C_SUB));
        idemp_pgarray_add(&seqs, idemp_rows_get(heads, i, C_SEQ));
    }
    const char *p[] = {idemp_pgarray_str(&subs), idemp_pgarray_str(&seqs), per};
    int rc = p[0] && p[1] ? idemp_pg_pipeline_begin(sl->pg, err)
                          : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    if (rc == IDEM_OK)
        rc = idemp_pg_queue(sl->pg, SQL_CLAIM_ROWS, 3, p, true, err);
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_send(sl->pg, err);
    idemp_pgarray_free(&subs);
    idemp_pgarray_free(&seqs);
    sl->phase = SLOT_READING;
    idemp_relay_sent(sl);
    return rc;
}

int idemp_relay_claim_step(idem_relay_t *r, slot_t *sl, idemp_rows_t **rows, size_t *claimed,
                           idem_error_t *err)
{
    idemp_rows_t *res = rows[0];
    rows[0] = NULL;
    *claimed = 0;
    if (sl->phase == SLOT_LOCKING) {
        int nheads = idemp_rows_count(res);
        if (nheads == 0) {
            idemp_rows_free(res);
            return idemp_relay_settle(r, sl, false, err); /* nothing due */
        }
        /* the next claim walks on from the last head (the results come in walk order) */
        snprintf(r->cursor, sizeof r->cursor, "%s", idemp_rows_get(res, nheads - 1, C_SUB));
        sl->heads = res;
        if (rows_per_head(r, nheads) > 0)
            return read_rows(r, sl, res, err);
        res = NULL; /* (nearly) a whole batch of heads: nothing more to read */
    }
    sl->t_claim = idemp_now_ms();
    int rc = load_rows(r, sl, sl->heads, res, err);
    sl->res = res;
    if (rc != IDEM_OK)
        return rc; /* the caller rolls back (and frees the results) */
    *claimed = sl->n;
    if (sl->n == 0)
        return idemp_relay_settle(r, sl, false, err); /* every row was taken meanwhile */
    sl->phase = SLOT_PUBLISHING;
    rc = idemp_relay_publish(r, sl, err);
    sl->t_pub = idemp_now_ms();
    return rc;
}

int idemp_relay_check_schema(idem_relay_t *r, idem_error_t *err)
{
    for (int i = 0; i < r->nslots && !r->schema_checked; i++) {
        PGconn *conn = idemp_pg_conn(r->slots[i].pg);
        if (conn == NULL || r->slots[i].phase != SLOT_FREE)
            continue;
        idem_error_t e = {0};
        int rc = idemp_pg_schema_check(conn, NULL, &e);
        if (rc == IDEM_ERR_NOT_FOUND || rc == IDEM_ERR_REFUSED)
            return idem_error_set(err, IDEM_ERR_NOT_FOUND, "%s", e.text);
        if (rc != IDEM_OK) {
            idemp_pg_disconnect(r->slots[i].pg, e.text);
            return r->cfg.once ? idem_error_set(err, rc, "%s", e.text) : IDEM_OK;
        }
        r->schema_checked = true;
    }
    return IDEM_OK;
}
