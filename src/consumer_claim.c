/* consumer_claim.c - the statements that open a batch's transaction: the transaction-local
 * settings and the claim of its event ids in the dedup ledger (plain, or all-new for the
 * one-round-trip batch). consumer_tx.c runs them and settles what they find. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
 * (idem_stale_before, sql/008_claim_guard.sql: by the database's clock, $4 the dedup window in
 * ms), so that their ledger rows cannot have been deleted by retention; reports the stale ones.
 * Ids are inserted in the batch's order, a stable lock order. */
#define SQL_CLAIM                                                                                  \
    "WITH c AS (SELECT e, ts, i FROM unnest($2::uuid[], $3::bigint[]) WITH ORDINALITY AS c(e, "    \
    "ts, i)), t AS (SELECT idem.idem_stale_before($4::bigint) AS cut), "                           \
    "ins AS (INSERT INTO idem.consumed_events (consumer, event_id) SELECT $1, c.e FROM c, t "      \
    "WHERE c.ts IS NULL OR c.ts >= t.cut ORDER BY c.i "                                            \
    "ON CONFLICT DO NOTHING RETURNING event_id) "                                                  \
    "SELECT event_id::text, 'c' FROM ins UNION ALL "                                               \
    "SELECT c.e::text, 's' FROM c, t WHERE c.ts IS NOT NULL AND c.ts < t.cut"

/* The claim of a batch whose handlers are queued behind it before its answer is read: as
 * SQL_CLAIM, and unless every id of the batch is claimed, idem_claim_check fails it with SQLSTATE
 * IDEM1 (sql/007_claim_check.sql), and with it the rest of the pipeline and the COMMIT. */
#define SQL_CLAIM_ALL                                                                              \
    "WITH c AS (SELECT e, ts, i FROM unnest($2::uuid[], $3::bigint[]) WITH ORDINALITY AS c(e, "    \
    "ts, i)), t AS (SELECT idem.idem_stale_before($4::bigint) AS cut), "                           \
    "ins AS (INSERT INTO idem.consumed_events (consumer, event_id) SELECT $1, c.e FROM c, t "      \
    "WHERE c.ts IS NULL OR c.ts >= t.cut ORDER BY c.i "                                            \
    "ON CONFLICT DO NOTHING RETURNING 1) "                                                         \
    "SELECT idem.idem_claim_check((SELECT count(*) FROM ins), $5::integer)"

static void build_arrays(delivery_t **ds, size_t n, idemp_pgarray_t *ids, idemp_pgarray_t *tss)
{
    idemp_pgarray_init(ids);
    idemp_pgarray_init(tss);
    for (size_t i = 0; i < n; i++) {
        char ts[24];
        idemp_pgarray_add(ids, ds[i]->ev.event_id);
        if (ds[i]->ev.has_timestamp)
            snprintf(ts, sizeof ts, "%lld", (long long)ds[i]->ev.timestamp_s);
        idemp_pgarray_add(tss, ds[i]->ev.has_timestamp ? ts : NULL);
    }
}

/* BEGIN, settings and the claim, pipelined in one round trip; marks claimed[] and stale[]. A
 * single delivery leaves pipeline mode here, so that its handler's statements fail one by one
 * (the failure policy needs to know which one failed); a batch stays pipelined. With all_new the
 * claim is only queued, every delivery taken as claimed: it fails the transaction if one is not
 * (SQL_CLAIM_ALL). */
int idemp_consumer_claim(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                         bool all_new, bool *claimed, bool *stale, idem_error_t *err)
{
    idemp_pgarray_t ids, tss;
    build_arrays(ds, n, &ids, &tss);
    const char *ids_s = idemp_pgarray_str(&ids), *tss_s = idemp_pgarray_str(&tss);
    int rc = ids_s && tss_s ? IDEM_OK : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
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
        const char *p[] = {c->consumer, ids_s, tss_s, c->window_ms, want};
        rc = idemp_pg_exec(pg, SQL_CLAIM_ALL, 5, p, NULL, err);
        for (size_t i = 0; i < n; i++)
            claimed[i] = true;
    } else if (rc == IDEM_OK) {
        const char *p[] = {c->consumer, ids_s, tss_s, c->window_ms};
        rc = single ? idemp_pg_pipeline_finish(pg, SQL_CLAIM, 4, p, &res, err)
                    : idemp_pg_exec(pg, SQL_CLAIM, 4, p, &res, err);
    }
    for (int r = 0; rc == IDEM_OK && r < idemp_rows_count(res); r++) {
        char kind = idemp_rows_get(res, r, 1)[0];
        const char *id = idemp_rows_get(res, r, 0);
        bool is_stale = kind == 's';
        for (size_t i = 0; i < n; i++) {
            if (memcmp(ds[i]->ev.event_id, id, 36) != 0)
                continue;
            if (is_stale) {
                stale[i] = true; /* every delivery of that id */
            } else if (!claimed[i]) {
                claimed[i] = true; /* a repeat of an id in the same batch stays unclaimed */
                break;
            }
        }
    }
    idemp_rows_free(res);
    idemp_pgarray_free(&ids);
    idemp_pgarray_free(&tss);
    return rc;
}
