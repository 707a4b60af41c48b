/* consumer_claim.c - the statements that open a batch's transaction: the transaction-local
 * settings and the claim of its event ids in the dedup ledger (plain, or all-new for the
 * one-round-trip batch). consumer_tx.c runs them and settles what they find. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "consumer_int.h"

/* The claim's transaction begins here. Its settings are transaction-local, so nothing leaks to
 * other clients of a pooled server connection: synchronous_commit on (the ack follows a COMMIT
 * that is durable whatever the server's or the session's default; remote_apply is kept), and the
 * marks that idem_claim_commit checks before the runtime's COMMIT (sql/008_claim_guard.sql). The
 * upsert of idem_claim_guard arms the deferred trigger that refuses any other COMMIT of this
 * transaction, such as a handler's own. */
#define SQL_SETTINGS                                                                               \
    "WITH g AS (INSERT INTO idem.idem_claim_guard AS g (pid) VALUES (pg_backend_pid()) "           \
    "ON CONFLICT (pid) DO UPDATE SET uses = g.uses + 1) "                                          \
    "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true),"      \
    " set_config('jit', 'off', true), set_config('synchronous_commit', "                           \
    "CASE current_setting('synchronous_commit') WHEN 'remote_apply' THEN 'remote_apply' "          \
    "ELSE 'on' END, true), set_config('idem.claim', 'on', true), "                                 \
    "set_config('idem.search_path', current_setting('search_path'), true)"

/* Claims the ids that are new for the consumer and not stale by the one stale rule
 * (idem_stale_before, sql/008_claim_guard.sql: by the database's clock, $5 the dedup window in
 * ms), so that their ledger rows cannot have been deleted by retention, each with the digest of
 * its content ($4, hex: digest.h). Reports the stale ones ('s', by id), and, by their place in
 * the batch (1-based), the deliveries whose id is in the ledger with another digest ('x': a
 * conflict, not a duplicate) or whose row this statement cannot see ('u': committed by another
 * transaction after the statement began, the insert having waited for it; see SQL_DIGESTS). A
 * row inserted here counts against the batch's other deliveries of its id. A row or a delivery
 * without a digest (written before there were digests; out of memory) is compared with nothing.
 * Ids are inserted in the batch's order, a stable lock order. */
#define SQL_CLAIM                                                                                  \
    "WITH c AS (SELECT e, ts, decode(d, 'hex') AS d, i FROM unnest($2::uuid[], $3::bigint[], "     \
    "$4::text[]) WITH ORDINALITY AS c(e, ts, d, i)), t AS (SELECT "                                \
    "idem.idem_stale_before($5::bigint) "                                                          \
    "AS cut), ins AS (INSERT INTO idem.consumed_events (consumer, event_id, digest) SELECT $1, "   \
    "c.e, "                                                                                        \
    "c.d FROM c, t WHERE c.ts IS NULL OR c.ts >= t.cut ORDER BY c.i "                              \
    "ON CONFLICT DO NOTHING RETURNING event_id, digest) "                                          \
    "SELECT event_id::text, 'c', 0::bigint FROM ins UNION ALL "                                    \
    "SELECT c.e::text, 's', 0 FROM c, t WHERE c.ts IS NOT NULL AND c.ts < t.cut UNION ALL "        \
    "SELECT c.e::text, CASE WHEN n.event_id IS NULL AND l.event_id IS NULL THEN 'u' ELSE 'x' END," \
    " c.i FROM c CROSS JOIN t LEFT JOIN ins n ON n.event_id = c.e LEFT JOIN idem.consumed_events " \
    "l ON "                                                                                        \
    "l.consumer = $1 AND l.event_id = c.e WHERE (c.ts IS NULL OR c.ts >= t.cut) AND c.d IS NOT "   \
    "NULL AND CASE WHEN n.event_id IS NOT NULL THEN n.digest <> c.d "                              \
    "WHEN l.event_id IS NOT NULL THEN l.digest <> c.d ELSE true END"

/* The digests of rows that SQL_CLAIM could not see, read by a statement of their own (a new
 * snapshot, in the claim's transaction): the places (1-based, among the ids given) whose row has
 * another digest. */
#define SQL_DIGESTS                                                                                \
    "SELECT c.i FROM unnest($2::uuid[], $3::text[]) WITH ORDINALITY AS c(e, d, i) "                \
    "JOIN idem.consumed_events l ON l.consumer = $1 AND l.event_id = c.e "                         \
    "WHERE l.digest <> decode(c.d, 'hex')"

/* The claim of a batch whose handlers are queued behind it before its answer is read: as
 * SQL_CLAIM, and unless every id of the batch is claimed, idem_claim_check fails it with SQLSTATE
 * IDEM1 (sql/007_claim_check.sql), and with it the rest of the pipeline and the COMMIT. */
#define SQL_CLAIM_ALL                                                                              \
    "WITH c AS (SELECT e, ts, decode(d, 'hex') AS d, i FROM unnest($2::uuid[], $3::bigint[], "     \
    "$4::text[]) WITH ORDINALITY AS c(e, ts, d, i)), t AS (SELECT "                                \
    "idem.idem_stale_before($5::bigint) "                                                          \
    "AS cut), ins AS (INSERT INTO idem.consumed_events (consumer, event_id, digest) SELECT $1, "   \
    "c.e, "                                                                                        \
    "c.d FROM c, t WHERE c.ts IS NULL OR c.ts >= t.cut ORDER BY c.i "                              \
    "ON CONFLICT DO NOTHING RETURNING 1) "                                                         \
    "SELECT idem.idem_claim_check((SELECT count(*) FROM ins), $6::integer)"

typedef struct claim_arrays {
    idemp_pgarray_t ids, tss, digests;
} claim_arrays_t;

static void arrays_free(claim_arrays_t *a)
{
    idemp_pgarray_free(&a->ids);
    idemp_pgarray_free(&a->tss);
    idemp_pgarray_free(&a->digests);
}

/* The ids, timestamps and digests of ds[i] for every i with pick[i] (pick NULL: all). */
static void build_arrays(delivery_t **ds, size_t n, const bool *pick, claim_arrays_t *a)
{
    idemp_pgarray_init(&a->ids);
    idemp_pgarray_init(&a->tss);
    idemp_pgarray_init(&a->digests);
    for (size_t i = 0; i < n; i++) {
        if (pick != NULL && !pick[i])
            continue;
        char ts[24];
        idemp_pgarray_add(&a->ids, ds[i]->ev.event_id);
        if (ds[i]->ev.has_timestamp)
            snprintf(ts, sizeof ts, "%lld", (long long)ds[i]->ev.timestamp_s);
        idemp_pgarray_add(&a->tss, ds[i]->ev.has_timestamp ? ts : NULL);
        idemp_pgarray_add(&a->digests, ds[i]->digest[0] ? ds[i]->digest : NULL);
    }
}

/* Settles the 'u' rows of SQL_CLAIM (unseen[i]): their digests read again (SQL_DIGESTS), the ones
 * that differ marked conflict[i]. Rare: only a row of the same id committed by another
 * transaction while the claim waited for it. */
static int read_unseen(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n,
                       const bool *unseen, bool *conflict, idem_error_t *err)
{
    claim_arrays_t a;
    build_arrays(ds, n, unseen, &a);
    idemp_consumer_log(IDEM_LOG_DEBUG, c, NULL,
                       "claim: %zu id(s) committed by another transaction while the claim waited "
                       "for them; their digests are read again",
                       a.ids.n);
    const char *ids_s = idemp_pgarray_str(&a.ids), *dg_s = idemp_pgarray_str(&a.digests);
    idemp_rows_t *res = NULL;
    int rc = ids_s && dg_s ? IDEM_OK : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    if (rc == IDEM_OK) {
        const char *p[] = {c->consumer, ids_s, dg_s};
        rc = idemp_pg_exec(pg, SQL_DIGESTS, 3, p, &res, err);
    }
    for (int r = 0; rc == IDEM_OK && r < idemp_rows_count(res); r++) {
        long at = strtol(idemp_rows_get(res, r, 0), NULL, 10);
        for (size_t i = 0, k = 0; i < n; i++)
            if (unseen[i] && (long)++k == at)
                conflict[i] = true;
    }
    idemp_rows_free(res);
    arrays_free(&a);
    return rc;
}

/* BEGIN, settings and the claim, pipelined in one round trip; marks claimed[], stale[] and
 * conflict[]. A single delivery leaves pipeline mode here, so that its handler's statements fail
 * one by one (the failure policy needs to know which one failed); a batch stays pipelined. With
 * all_new the claim is only queued, every delivery taken as claimed: it fails the transaction if
 * one is not (SQL_CLAIM_ALL). */
int idemp_consumer_claim(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                         bool all_new, bool *claimed, bool *stale, bool *conflict,
                         idem_error_t *err)
{
    claim_arrays_t a;
    build_arrays(ds, n, NULL, &a);
    const char *ids_s = idemp_pgarray_str(&a.ids), *tss_s = idemp_pgarray_str(&a.tss),
               *dg_s = idemp_pgarray_str(&a.digests);
    bool *unseen = calloc(n, sizeof *unseen);
    bool any_unseen = false;
    int rc = ids_s && tss_s && dg_s && unseen
                 ? IDEM_OK
                 : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    if (rc == IDEM_OK)
        rc = idemp_pg_command(pg, "BEGIN", err);
    if (rc == IDEM_OK) {
        const char *p[] = {c->settings[0], c->settings[1]};
        rc = idemp_pg_exec(pg, SQL_SETTINGS, 2, p, NULL, err);
    }
    idemp_rows_t *res = NULL;
    if (rc == IDEM_OK && all_new) {
        char want[24];
        snprintf(want, sizeof want, "%zu", n);
        const char *p[] = {c->consumer, ids_s, tss_s, dg_s, c->window_ms, want};
        rc = idemp_pg_exec(pg, SQL_CLAIM_ALL, 6, p, NULL, err);
        for (size_t i = 0; i < n; i++)
            claimed[i] = true;
    } else if (rc == IDEM_OK) {
        const char *p[] = {c->consumer, ids_s, tss_s, dg_s, c->window_ms};
        rc = single ? idemp_pg_pipeline_finish(pg, SQL_CLAIM, 5, p, &res, err)
                    : idemp_pg_exec(pg, SQL_CLAIM, 5, p, &res, err);
    }
    for (int r = 0; rc == IDEM_OK && r < idemp_rows_count(res); r++) {
        char kind = idemp_rows_get(res, r, 1)[0];
        const char *id = idemp_rows_get(res, r, 0);
        if (kind == 'x' || kind == 'u') {
            long at = strtol(idemp_rows_get(res, r, 2), NULL, 10);
            if (at >= 1 && (size_t)at <= n) {
                (kind == 'x' ? conflict : unseen)[at - 1] = true;
                any_unseen = any_unseen || kind == 'u';
            }
            continue;
        }
        for (size_t i = 0; i < n; i++) {
            if (memcmp(ds[i]->ev.event_id, id, 36) != 0)
                continue;
            if (kind == 's') {
                stale[i] = true; /* every delivery of that id */
            } else if (!claimed[i]) {
                claimed[i] = true; /* a repeat of an id in the same batch stays unclaimed */
                break;
            }
        }
    }
    idemp_rows_free(res);
    if (rc == IDEM_OK && any_unseen)
        rc = read_unseen(c, pg, ds, n, unseen, conflict, err);
    free(unseen);
    arrays_free(&a);
    return rc;
}
