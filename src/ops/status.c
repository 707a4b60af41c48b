/* status.c - backlog health (`idem status`) and the list of failed rows (`idem failed`).
 *
 * Read-only. Status reads both tables in one REPEATABLE READ transaction so that the totals
 * and the ledger line describe the same moment. */
#include <stdlib.h>
#include <string.h>

#include <idem/ops.h>

#include "pg.h"

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

#define STATUS_LEDGER "SELECT count(*), " RFC3339("min(consumed_at)") " FROM idem.consumed_events"

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
    put(led, "rows", int_or_null(ledger, 0, 0), &ok);
    put(led, "oldest_consumed_at", str_or_null(ledger, 0, 1), &ok);
    put(doc, "event_types", list, &ok);
    put(doc, "totals", totals, &ok);
    put(doc, "ledger", led, &ok);
    if (!ok) {
        json_decref(doc);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    *out = doc;
    return IDEM_OK;
}

int idem_status_query(PGconn *conn, json_t **out, idem_error_t *err)
{
    *out = NULL;
    int rc = idemp_pgconn_exec(conn, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", 0, NULL,
                               NULL, err);
    if (rc != IDEM_OK)
        return rc;
    idemp_rows_t *types = NULL, *ledger = NULL;
    rc = idemp_pgconn_exec(conn, STATUS_TYPES, 0, NULL, &types, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, STATUS_LEDGER, 0, NULL, &ledger, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
    else if (idemp_pgconn_ok(conn))
        idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
    if (rc == IDEM_OK)
        rc = build_status(types, ledger, out, err);
    idemp_rows_free(types);
    idemp_rows_free(ledger);
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
