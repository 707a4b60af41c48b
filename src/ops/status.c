/* status.c - backlog health (`idem status`) and the list of failed rows (`idem failed`).
 *
 * Read-only. Status reads both tables in one REPEATABLE READ transaction so that the totals
 * and the ledger line describe the same moment. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/ops.h>

#include "pg.h"
#include "rmq.h"

#define RFC3339(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"

/* Types with pending or failed rows. Ages are in seconds with millisecond precision (NULL when a
 * type has no pending row; greatest() would turn that NULL into 0). */
#define STATUS_TYPES                                                                               \
    "SELECT event_type, count(*) FILTER (WHERE status = 'pending'), "                              \
    "round(extract(epoch FROM now() - min(created_at) "                                            \
    "FILTER (WHERE status = 'pending'))::numeric, 3), "                                            \
    "count(*) FILTER (WHERE status = 'failed') "                                                   \
    "FROM idem.event_outbox WHERE status IN ('pending', 'failed') "                                \
    "GROUP BY event_type ORDER BY event_type"

/* The ledger per consumer and as a whole (the first row: GROUPING SETS' () row), one scan. */
#define STATUS_LEDGER                                                                              \
    "SELECT consumer, count(*), " RFC3339("min(consumed_at)") ", " RFC3339(                        \
        "max(consumed_at)") ", round(extract(epoch FROM now() - max(consumed_at))::numeric, 3) "   \
                            "FROM idem.consumed_events GROUP BY GROUPING SETS ((), (consumer)) "   \
                            "ORDER BY grouping(consumer) DESC, consumer"

/* Why each pending row waits, read from the rows and from the locks their relays hold. A row
 * locked by an open transaction (a relay's claim: FOR UPDATE sets the row's xmax to the
 * transaction's id, and every transaction holds an ExclusiveLock on its own id) is in flight on
 * that backend; a row whose next attempt is in the future waits for its retry; a row behind a
 * waiting row of its subscription is held (a relay claims a subscription's rows only from its
 * first pending row); a row behind a row in flight waits for that batch; anything else is due and
 * no relay has taken it. One statement over one materialized set of the pending rows: the counts
 * per reason ('count'), the backends holding rows ('pid'), and the $1 oldest rows ('row') with
 * the row that holds them back. */
#define STATUS_WAITING                                                                             \
    "WITH l AS (SELECT transactionid AS x, pid FROM pg_catalog.pg_locks"                           \
    "            WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' AND granted"          \
    "              AND pid <> pg_catalog.pg_backend_pid()),"                                       \
    " p AS (SELECT o.event_id, o.event_type, o.subscription_id, o.seq, o.attempts, o.created_at,"  \
    "              o.next_attempt_at, l.pid, o.next_attempt_at > now() AS later"                   \
    "         FROM idem.event_outbox o LEFT JOIN l ON l.x = o.xmax WHERE o.status = 'pending'),"   \
    " s AS (SELECT subscription_id, min(seq) FILTER (WHERE later AND pid IS NULL) AS retry_seq,"   \
    "              min(seq) FILTER (WHERE pid IS NOT NULL) AS lock_seq"                            \
    "         FROM p GROUP BY subscription_id),"                                                   \
    " r AS MATERIALIZED (SELECT p.*, s.retry_seq, s.lock_seq,"                                     \
    "              CASE WHEN p.pid IS NOT NULL THEN 'in_flight' WHEN p.later THEN 'retrying'"      \
    "                   WHEN s.retry_seq < p.seq THEN 'held'"                                      \
    "                   WHEN s.lock_seq < p.seq THEN 'behind_in_flight' ELSE 'due' END AS reason"  \
    "         FROM p JOIN s USING (subscription_id))"                                              \
    "SELECT 'count', reason, count(*), NULL::int, NULL, NULL, NULL, NULL::int, NULL::numeric,"     \
    "       NULL::numeric, NULL, NULL::int, NULL, NULL, NULL, NULL::numeric, NULL::int"            \
    "  FROM r GROUP BY reason "                                                                    \
    "UNION ALL "                                                                                   \
    "SELECT 'pid', NULL, count(*), r.pid, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"         \
    "       a.application_name, a.usename::text, a.state,"                                         \
    "       round(extract(epoch FROM now() - a.xact_start)::numeric, 1),"                          \
    "       substring(a.application_name FROM '^idem relay pid ([0-9]+)$')::int"                   \
    "  FROM r LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = r.pid WHERE r.pid IS NOT NULL"    \
    " GROUP BY r.pid, a.application_name, a.usename, a.state, a.xact_start "                       \
    "UNION ALL "                                                                                   \
    "(SELECT 'row', r.reason, NULL, coalesce(r.pid, bl.pid), r.event_id::text, r.event_type,"      \
    "        r.subscription_id::text, r.attempts,"                                                 \
    "        round(extract(epoch FROM now() - r.created_at)::numeric, 1),"                         \
    "        round(extract(epoch FROM coalesce(b.next_attempt_at, r.next_attempt_at) - now())"     \
    "              ::numeric, 1),"                                                                 \
    "        b.event_id::text, b.attempts, NULL, NULL, NULL, NULL,"                                \
    "        (SELECT substring(a.application_name FROM '^idem relay pid ([0-9]+)$')::int"          \
    "           FROM pg_catalog.pg_stat_activity a WHERE a.pid = coalesce(r.pid, bl.pid))"         \
    "   FROM r LEFT JOIN idem.event_outbox b ON b.status = 'pending'"                              \
    "        AND b.subscription_id = r.subscription_id"                                            \
    "        AND b.seq = CASE r.reason WHEN 'held' THEN r.retry_seq"                               \
    "                                  WHEN 'behind_in_flight' THEN r.lock_seq END"                \
    "   LEFT JOIN l bl ON bl.x = b.xmax"                                                           \
    "  ORDER BY r.seq LIMIT $1)"

/* The reasons of STATUS_WAITING, in the order the text output lists them. */
static const char *const REASONS[] = {"in_flight", "behind_in_flight", "retrying", "held", "due"};
#define NREASONS (sizeof REASONS / sizeof REASONS[0])

#define FAILED_LIST                                                                                \
    "SELECT event_id, outbox_id, event_type, subscription_id, attempts, " RFC3339(                 \
        "created_at") ", last_error FROM idem.event_outbox WHERE status = 'failed' ORDER BY "      \
                      "created_at, seq"

static json_t *int_or_null(const idemp_rows_t *r, int row, int col)
{
    if (idemp_rows_isnull(r, row, col))
        return json_null();
    return json_integer(strtoll(idemp_rows_get(r, row, col), NULL, 10));
}

/* An age in seconds, clamped at zero: created_at comes from the emitting transaction's clock. */
static json_t *age_or_null(const idemp_rows_t *r, int row, int col)
{
    if (idemp_rows_isnull(r, row, col))
        return json_null();
    double age = strtod(idemp_rows_get(r, row, col), NULL);
    return json_real(age > 0 ? age : 0.0);
}

static json_t *str_or_null(const idemp_rows_t *r, int row, int col)
{
    if (idemp_rows_isnull(r, row, col))
        return json_null();
    return json_string(idemp_rows_get(r, row, col));
}

/* json_object_set_new that fails on NULL values (out of memory) instead of ignoring them. */
static int put(json_t *obj, const char *key, json_t *val, int *ok)
{
    if (val == NULL || json_object_set_new(obj, key, val) != 0)
        *ok = 0;
    return *ok;
}

static int build_status(const idemp_rows_t *types, const idemp_rows_t *ledger, json_t **out,
                        idem_error_t *err)
{
    int ok = 1;
    json_t *doc = json_object(), *list = json_array(), *totals = json_object(),
           *led = json_object();
    if (doc == NULL || list == NULL || totals == NULL || led == NULL) {
        json_decref(doc);
        json_decref(list);
        json_decref(totals);
        json_decref(led);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    long long pending = 0, failed = 0;
    double oldest = -1;
    for (int i = 0; i < idemp_rows_count(types) && ok; i++) {
        json_t *t = json_object();
        if (t == NULL || json_array_append_new(list, t) != 0) {
            ok = 0;
            break;
        }
        put(t, "event_type", str_or_null(types, i, 0), &ok);
        put(t, "pending", int_or_null(types, i, 1), &ok);
        put(t, "oldest_pending_seconds", age_or_null(types, i, 2), &ok);
        put(t, "failed", int_or_null(types, i, 3), &ok);
        pending += strtoll(idemp_rows_get(types, i, 1), NULL, 10);
        failed += strtoll(idemp_rows_get(types, i, 3), NULL, 10);
        if (!idemp_rows_isnull(types, i, 2)) {
            double age = strtod(idemp_rows_get(types, i, 2), NULL);
            if (age < 0)
                age = 0;
            if (age > oldest)
                oldest = age;
        }
    }
    put(totals, "pending", json_integer(pending), &ok);
    put(totals, "failed", json_integer(failed), &ok);
    put(totals, "oldest_pending_seconds", oldest >= 0 ? json_real(oldest) : json_null(), &ok);
    put(led, "rows", int_or_null(ledger, 0, 1), &ok);
    put(led, "oldest_consumed_at", str_or_null(ledger, 0, 2), &ok);
    put(doc, "event_types", list, &ok);
    put(doc, "totals", totals, &ok);
    put(doc, "ledger", led, &ok);
    json_t *consumers = json_array();
    put(doc, "consumers", consumers, &ok);
    for (int i = 1; i < idemp_rows_count(ledger) && ok; i++) {
        json_t *c = json_object();
        if (c == NULL || json_array_append_new(consumers, c) != 0) {
            ok = 0;
            break;
        }
        put(c, "consumer", str_or_null(ledger, i, 0), &ok);
        put(c, "ledger_rows", int_or_null(ledger, i, 1), &ok);
        put(c, "last_applied_at", str_or_null(ledger, i, 3), &ok);
        put(c, "last_applied_seconds", age_or_null(ledger, i, 4), &ok);
        put(c, "queues", json_array(), &ok);
    }
    if (!ok) {
        json_decref(doc);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    *out = doc;
    return IDEM_OK;
}

static json_t *real_or_null(const idemp_rows_t *r, int row, int col)
{
    if (idemp_rows_isnull(r, row, col))
        return json_null();
    return json_real(strtod(idemp_rows_get(r, row, col), NULL));
}

/* doc["pending_rows"] from STATUS_WAITING's rows. */
static int build_waiting(json_t *doc, const idemp_rows_t *w)
{
    int ok = 1;
    json_t *pr = json_object(), *counts = json_object(), *holders = json_array(),
           *rows = json_array();
    put(doc, "pending_rows", pr, &ok);
    put(pr, "by_reason", counts, &ok);
    put(pr, "holders", holders, &ok);
    put(pr, "oldest", rows, &ok);
    for (size_t k = 0; k < NREASONS && ok; k++)
        put(counts, REASONS[k], json_integer(0), &ok);
    for (int i = 0; i < idemp_rows_count(w) && ok; i++) {
        const char *kind = idemp_rows_get(w, i, 0);
        if (strcmp(kind, "count") == 0) {
            put(counts, idemp_rows_get(w, i, 1), int_or_null(w, i, 2), &ok);
            continue;
        }
        json_t *o = json_object();
        if (o == NULL || json_array_append_new(strcmp(kind, "pid") == 0 ? holders : rows, o) != 0)
            return 0;
        if (strcmp(kind, "pid") == 0) {
            put(o, "pid", int_or_null(w, i, 3), &ok);
            put(o, "rows", int_or_null(w, i, 2), &ok);
            put(o, "application_name", str_or_null(w, i, 12), &ok);
            put(o, "user", str_or_null(w, i, 13), &ok);
            put(o, "state", str_or_null(w, i, 14), &ok);
            put(o, "transaction_seconds", real_or_null(w, i, 15), &ok);
            /* an idem relay names its sessions "idem relay pid N": N is its process */
            put(o, "relay_pid", int_or_null(w, i, 16), &ok);
            continue;
        }
        const char *reason = idemp_rows_get(w, i, 1);
        bool held = strcmp(reason, "held") == 0, behind = strcmp(reason, "behind_in_flight") == 0;
        put(o, "event_id", str_or_null(w, i, 4), &ok);
        put(o, "event_type", str_or_null(w, i, 5), &ok);
        put(o, "subscription_id", str_or_null(w, i, 6), &ok);
        put(o, "attempts", int_or_null(w, i, 7), &ok);
        put(o, "age_seconds", age_or_null(w, i, 8), &ok);
        put(o, "reason", json_string(reason), &ok);
        /* the backend holding it (or the row it waits behind) */
        put(o, "pid", int_or_null(w, i, 3), &ok);
        put(o, "relay_pid", int_or_null(w, i, 16), &ok);
        /* retrying: its own next attempt; held: that of the retrying row it waits behind */
        put(o, "next_attempt_in_seconds",
            strcmp(reason, "retrying") == 0 || held ? real_or_null(w, i, 9) : json_null(), &ok);
        put(o, "behind_event_id", held || behind ? str_or_null(w, i, 10) : json_null(), &ok);
        put(o, "behind_attempts", held ? int_or_null(w, i, 11) : json_null(), &ok);
    }
    return ok;
}

int idem_status_query(PGconn *conn, json_t **out, idem_error_t *err)
{
    return idem_status_query_with(conn, -1, out, err);
}

int idem_status_query_with(PGconn *conn, int explain_rows, json_t **out, idem_error_t *err)
{
    *out = NULL;
    int rc = idemp_pgconn_exec(conn, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", 0, NULL,
                               NULL, err);
    if (rc != IDEM_OK)
        return rc;
    idemp_rows_t *types = NULL, *ledger = NULL, *waiting = NULL;
    rc = idemp_pgconn_exec(conn, STATUS_TYPES, 0, NULL, &types, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, STATUS_LEDGER, 0, NULL, &ledger, err);
    char limit[16];
    snprintf(limit, sizeof limit, "%d", explain_rows);
    const char *params[] = {limit};
    if (rc == IDEM_OK && explain_rows >= 0)
        rc = idemp_pgconn_exec(conn, STATUS_WAITING, 1, params, &waiting, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
    else if (idemp_pgconn_ok(conn))
        idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
    if (rc == IDEM_OK)
        rc = build_status(types, ledger, out, err);
    if (rc == IDEM_OK && waiting != NULL && !build_waiting(*out, waiting)) {
        json_decref(*out);
        *out = NULL;
        rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    idemp_rows_free(types);
    idemp_rows_free(ledger);
    idemp_rows_free(waiting);
    return rc;
}

int idem_failed_list(PGconn *conn, json_t **out, idem_error_t *err)
{
    *out = NULL;
    idemp_rows_t *r;
    int rc = idemp_pgconn_exec(conn, FAILED_LIST, 0, NULL, &r, err);
    if (rc != IDEM_OK)
        return rc;
    json_t *list = json_array();
    int ok = list != NULL;
    static const char *const keys[] = {"event_id", "outbox_id",  "event_type", "subscription_id",
                                       "attempts", "created_at", "last_error"};
    for (int i = 0; i < idemp_rows_count(r) && ok; i++) {
        json_t *row = json_object();
        if (row == NULL || json_array_append_new(list, row) != 0) {
            ok = 0;
            break;
        }
        for (int c = 0; c < 7 && ok; c++)
            put(row, keys[c], c == 4 ? int_or_null(r, i, c) : str_or_null(r, i, c), &ok);
    }
    idemp_rows_free(r);
    if (!ok) {
        json_decref(list);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    *out = list;
    return IDEM_OK;
}

/* ---- queue depths (RabbitMQ) ---- */

/* The entry of doc["consumers"] for consumer (NULL: a new one without a consumer). */
static json_t *consumer_entry(json_t *doc, const char *consumer)
{
    json_t *list = json_object_get(doc, "consumers"), *c;
    size_t i;
    json_array_foreach(list, i, c)
    {
        const char *name = json_string_value(json_object_get(c, "consumer"));
        if (consumer != NULL && name != NULL && strcmp(name, consumer) == 0)
            return c;
    }
    c = json_pack("{s:o, s:i, s:n, s:n, s:[]}", "consumer",
                  consumer ? json_string(consumer) : json_null(), "ledger_rows", 0,
                  "last_applied_at", "last_applied_seconds", "queues");
    if (c == NULL || json_array_append_new(list, c) != 0)
        return NULL;
    return c;
}

/* The depths of queue and QUEUE.dlq into q; false when the connection is gone. */
static bool read_depths(idemp_amqp_t *a, const char *queue, json_t *q)
{
    char dlq[300];
    snprintf(dlq, sizeof dlq, "%s.dlq", queue);
    uint32_t ready = 0, consumers = 0, dready = 0, dcons = 0;
    idem_error_t e = {0};
    int rc = idemp_amqp_queue_info(a, queue, &ready, &consumers, &e);
    if (rc == IDEM_OK) {
        json_object_set_new(q, "ready", json_integer(ready));
        json_object_set_new(q, "consumers", json_integer(consumers));
    } else {
        json_object_set_new(q, "error",
                            json_string(rc == IDEM_ERR_NOT_FOUND ? "no such queue" : e.text));
        if (rc != IDEM_ERR_NOT_FOUND)
            return false;
    }
    idem_error_t de = {0};
    rc = idemp_amqp_queue_info(a, dlq, &dready, &dcons, &de);
    if (rc == IDEM_OK)
        json_object_set_new(q, "dlq_ready", json_integer(dready));
    else if (rc != IDEM_ERR_NOT_FOUND) {
        json_object_set_new(q, "error", json_string(de.text));
        return false;
    } else if (json_is_null(json_object_get(q, "error")))
        json_object_set_new(q, "error", json_string("no dead-letter queue"));
    return true;
}

int idem_status_queues(json_t *doc, const char *amqp_url, const char *amqp_password,
                       const char *const *queues, int n, idem_error_t *err)
{
    if (n <= 0)
        return IDEM_OK;
    idem_error_t cerr = {0};
    idemp_amqp_t *a = idemp_amqp_new(amqp_url, "status", 0, &cerr);
    if (a != NULL && amqp_password != NULL && idemp_amqp_set_password(a, amqp_password) != 0)
        idem_error_set(&cerr, IDEM_ERR_INVALID, "the AMQP password is too long");
    int rc = a != NULL && cerr.code == 0 ? idemp_amqp_connect(a, false, &cerr) : cerr.code;
    bool up = rc == IDEM_OK;
    for (int i = 0; i < n; i++) {
        const char *spec = queues[i], *eq = strchr(spec, '=');
        char consumer[256];
        const char *queue = spec;
        if (eq != NULL) {
            snprintf(consumer, sizeof consumer, "%.*s", (int)(eq - spec), spec);
            queue = eq + 1;
        }
        json_t *c = consumer_entry(doc, eq != NULL && eq > spec ? consumer : NULL);
        char dlq[300];
        snprintf(dlq, sizeof dlq, "%s.dlq", queue);
        json_t *q = json_pack("{s:s, s:n, s:n, s:s, s:n, s:n}", "queue", queue, "ready",
                              "consumers", "dlq", dlq, "dlq_ready", "error");
        if (c == NULL || q == NULL || json_array_append_new(json_object_get(c, "queues"), q) != 0) {
            rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
            break;
        }
        if (!up) {
            json_object_set_new(q, "error", json_string(cerr.text));
            continue;
        }
        if (!read_depths(a, queue, q)) {
            up = false;
            rc = idem_error_set(&cerr, IDEM_ERR_AMQP_LOST, "%s",
                                json_string_value(json_object_get(q, "error")));
        }
    }
    if (rc != IDEM_OK && rc != IDEM_ERR_NOMEM) {
        json_object_set_new(doc, "rabbitmq_error", json_string(cerr.text));
        if (err != NULL && err->code == 0)
            *err = cerr;
    } else if (rc == IDEM_OK)
        json_object_set_new(doc, "rabbitmq_error", json_null());
    if (a != NULL && idemp_amqp_connected(a))
        idemp_amqp_disconnect(a, NULL);
    idemp_amqp_free(a);
    return rc;
}
