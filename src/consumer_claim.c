/* consumer_claim.c - the statements that open a batch's transaction: the transaction-local
 * settings and the claim of its event ids in the dedup ledger (plain, all-new for the
 * one-round-trip batch, or partitioned with the routes and fences of sql/006), and the record of
 * the fences reached. consumer_tx.c runs them and settles what they find. */
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
    "WITH g AS (INSERT INTO idem_claim_guard AS g (pid) VALUES (pg_backend_pid()) "                \
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
    "ts, i)), t AS (SELECT idem_stale_before($4::bigint) AS cut), "                                \
    "ins AS (INSERT INTO consumed_events (consumer, event_id) SELECT $1, c.e FROM c, t "           \
    "WHERE c.ts IS NULL OR c.ts >= t.cut ORDER BY c.i "                                            \
    "ON CONFLICT DO NOTHING RETURNING event_id) "                                                  \
    "SELECT event_id::text, 'c' FROM ins UNION ALL "                                               \
    "SELECT c.e::text, 's' FROM c, t WHERE c.ts IS NOT NULL AND c.ts < t.cut"

/* The claim of a batch whose handlers are queued behind it before its answer is read: as
 * SQL_CLAIM, and unless every id of the batch is claimed, idem_claim_check fails it with SQLSTATE
 * IDEM1 (sql/007_claim_check.sql), and with it the rest of the pipeline and the COMMIT. */
#define SQL_CLAIM_ALL                                                                              \
    "WITH c AS (SELECT e, ts, i FROM unnest($2::uuid[], $3::bigint[]) WITH ORDINALITY AS c(e, "    \
    "ts, i)), t AS (SELECT idem_stale_before($4::bigint) AS cut), "                                \
    "ins AS (INSERT INTO consumed_events (consumer, event_id) SELECT $1, c.e FROM c, t "           \
    "WHERE c.ts IS NULL OR c.ts >= t.cut ORDER BY c.i "                                            \
    "ON CONFLICT DO NOTHING RETURNING 1) "                                                         \
    "SELECT idem_claim_check((SELECT count(*) FROM ins), $5::integer)"

/* The claim of a partitioned group (--partitions > 1), also keeping idem_partition_routes: a
 * delivery whose subscription was last applied from another partition is not claimed but
 * reported moved ('m', with that partition and its place in the batch), unless the fence it waits
 * for has been reached ($7); the others are claimed as above, new subscriptions' routes recorded,
 * moves whose fence was reached recorded, and the fences taken. See
 * sql/006_partition_routes.sql. */
#define SQL_CLAIM_PARTITIONED                                                                      \
    "WITH c AS (SELECT e, ts, s, p, f, i FROM unnest($2::uuid[], $3::bigint[], $5::uuid[], "       \
    "$6::int[], $7::uuid[]) WITH ORDINALITY AS c(e, ts, s, p, f, i)), "                            \
    "t AS (SELECT idem_stale_before($4::bigint) AS cut), "                                         \
    "r AS (SELECT subscription_id, partition FROM idem_partition_routes "                          \
    "WHERE consumer = $1 AND subscription_id IN (SELECT s FROM c)), "                              \
    "fr AS (SELECT fence_id FROM idem_partition_fences "                                           \
    "WHERE consumer = $1 AND fence_id IN (SELECT f FROM c)), "                                     \
    "m AS (SELECT c.i, r.partition AS was FROM c JOIN r ON r.subscription_id = c.s "               \
    "WHERE r.partition <> c.p AND (c.f IS NULL OR c.f NOT IN (SELECT fence_id FROM fr))), "        \
    "ok AS (SELECT * FROM c WHERE c.i NOT IN (SELECT i FROM m)), "                                 \
    "ins AS (INSERT INTO consumed_events (consumer, event_id) SELECT $1, ok.e FROM ok, t "         \
    "WHERE ok.ts IS NULL OR ok.ts >= t.cut ORDER BY ok.i "                                         \
    "ON CONFLICT DO NOTHING RETURNING event_id), "                                                 \
    "rn AS (INSERT INTO idem_partition_routes (consumer, subscription_id, partition) "             \
    "SELECT DISTINCT ON (ok.s) $1, ok.s, ok.p FROM ok WHERE ok.s IS NOT NULL "                     \
    "AND ok.s NOT IN (SELECT subscription_id FROM r) ORDER BY ok.s, ok.i ON CONFLICT DO "          \
    "NOTHING), "                                                                                   \
    "rm AS (UPDATE idem_partition_routes x SET partition = ok.p, moved_at = now() "                \
    "FROM ok JOIN r ON r.subscription_id = ok.s WHERE x.consumer = $1 "                            \
    "AND x.subscription_id = ok.s AND r.partition <> ok.p), "                                      \
    "fd AS (DELETE FROM idem_partition_fences WHERE consumer = $1 "                                \
    "AND fence_id IN (SELECT f FROM ok WHERE f IS NOT NULL)) "                                     \
    "SELECT event_id::text, 'c', NULL, NULL FROM ins UNION ALL "                                   \
    "SELECT ok.e::text, 's', NULL, NULL FROM ok, t "                                               \
    "WHERE ok.ts IS NOT NULL AND ok.ts < t.cut UNION ALL "                                         \
    "SELECT NULL, 'm', m.was::text, m.i::text FROM m"

/* Fences reached: recorded for the consumers waiting for them (see consumer.c); fences nobody
 * took within a day (their waiter went away) are cleared on the way. */
#define SQL_FENCES_REACHED                                                                         \
    "WITH old AS (DELETE FROM idem_partition_fences WHERE consumer = $1 "                          \
    "AND reached_at < now() - interval '1 day') "                                                  \
    "INSERT INTO idem_partition_fences (consumer, fence_id) "                                      \
    "SELECT $1, f FROM unnest($2::uuid[]) AS f ON CONFLICT DO NOTHING"

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

/* The partitioned claim's arrays: subscriptions, partitions, awaited fences. */
static void build_route_arrays(delivery_t **ds, size_t n, idemp_pgarray_t *subs,
                               idemp_pgarray_t *parts, idemp_pgarray_t *fences)
{
    idemp_pgarray_init(subs);
    idemp_pgarray_init(parts);
    idemp_pgarray_init(fences);
    for (size_t i = 0; i < n; i++) {
        char p[16];
        snprintf(p, sizeof p, "%d", ds[i]->part);
        /* a delivery of no known partition (or no subscription) takes no part in routing */
        bool routed = ds[i]->ev.subscription_id[0] && ds[i]->part >= 0;
        idemp_pgarray_add(subs, routed ? ds[i]->ev.subscription_id : NULL);
        idemp_pgarray_add(parts, p);
        idemp_pgarray_add(fences, ds[i]->fence_id[0] ? ds[i]->fence_id : NULL);
    }
}

/* BEGIN, settings and the claim, pipelined in one round trip; marks claimed[] and stale[]. A
 * single delivery leaves pipeline mode here, so that its handler's statements fail one by one
 * (the failure policy needs to know which one failed); a batch stays pipelined. With all_new the
 * claim is only queued, every delivery taken as claimed: it fails the transaction if one is not
 * (SQL_CLAIM_ALL). */
int idemp_consumer_claim(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                         bool all_new, bool *claimed, bool *stale, int *moved, idem_error_t *err)
{
    idemp_pgarray_t ids, tss, subs, parts, fences;
    bool routed = c->cfg.partitions > 1;
    build_arrays(ds, n, &ids, &tss);
    build_route_arrays(ds, routed ? n : 0, &subs, &parts, &fences);
    const char *ids_s = idemp_pgarray_str(&ids), *tss_s = idemp_pgarray_str(&tss);
    const char *subs_s = idemp_pgarray_str(&subs), *parts_s = idemp_pgarray_str(&parts),
               *fences_s = idemp_pgarray_str(&fences);
    int rc = ids_s && tss_s && subs_s && parts_s && fences_s
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
        const char *p[] = {c->consumer, ids_s, tss_s, c->window_ms, want};
        rc = idemp_pg_exec(pg, SQL_CLAIM_ALL, 5, p, NULL, err);
        for (size_t i = 0; i < n; i++)
            claimed[i] = true;
    } else if (rc == IDEM_OK) {
        const char *p[] = {c->consumer, ids_s, tss_s, c->window_ms, subs_s, parts_s, fences_s};
        const char *sql = routed ? SQL_CLAIM_PARTITIONED : SQL_CLAIM;
        int np = routed ? 7 : 4;
        rc = single ? idemp_pg_pipeline_finish(pg, sql, np, p, &res, err)
                    : idemp_pg_exec(pg, sql, np, p, &res, err);
    }
    for (int r = 0; rc == IDEM_OK && r < idemp_rows_count(res); r++) {
        char kind = idemp_rows_get(res, r, 1)[0];
        if (kind == 'm') {
            long i = strtol(idemp_rows_get(res, r, 3), NULL, 10);
            if (i >= 1 && (size_t)i <= n)
                moved[i - 1] = (int)strtol(idemp_rows_get(res, r, 2), NULL, 10);
            continue;
        }
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
    idemp_pgarray_free(&subs);
    idemp_pgarray_free(&parts);
    idemp_pgarray_free(&fences);
    return rc;
}

/* The fences among ds[0..n) are recorded as reached (one statement, its own transaction) and
 * become DONE; the events are moved to the front of ds. Returns how many events there are (0
 * when recording failed: the consumer then pauses and everything goes again). */
size_t idemp_consumer_record_fences(idem_consumer_t *c, delivery_t **ds, size_t n)
{
    idemp_pgarray_t ids;
    idemp_pgarray_init(&ids);
    size_t fences = 0;
    for (size_t i = 0; i < n; i++)
        if (ds[i]->fence) {
            idemp_pgarray_add(&ids, ds[i]->fence_id);
            fences++;
        }
    if (fences > 0) {
        const char *ids_s = idemp_pgarray_str(&ids);
        idem_error_t err = {0};
        int rc = ids_s ? IDEM_OK : idem_error_set(&err, IDEM_ERR_NOMEM, "out of memory");
        if (rc == IDEM_OK) {
            const char *p[] = {c->consumer, ids_s};
            rc = idemp_pg_exec(c->pg, SQL_FENCES_REACHED, 2, p, NULL, &err);
        }
        idemp_pgarray_free(&ids);
        if (rc != IDEM_OK) {
            const char *st = !idemp_pg_connected(c->pg) ? "08006"
                             : err.sqlstate[0]          ? err.sqlstate
                                                        : "XX000";
            idemp_consumer_pause(c, st, err.text);
            return 0;
        }
    } else {
        idemp_pgarray_free(&ids);
    }
    size_t events = 0;
    for (size_t i = 0; i < n; i++) {
        delivery_t *d = ds[i];
        if (d->fence) {
            d->state = D_DONE;
            idemp_consumer_log(IDEM_LOG_DEBUG, c, d, "fence %s reached", d->fence_id);
        } else {
            ds[events++] = d;
        }
    }
    return events;
}
