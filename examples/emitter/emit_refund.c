/* emit_refund.c - a business transaction that emits an event through the outbox: it records a
 * refund and queues refund.issued in one PostgreSQL transaction, so neither exists without the
 * other. A retried request (same REQUEST_KEY) finds its refund and emits nothing new: the event
 * id is md5("refund:" || REQUEST_KEY)::uuid, and idem_emit collapses a replay into the same id.
 *
 *   cc emit_refund.c $(pkg-config --cflags --libs idem) -o emit_refund
 *   IDEM_PG_URL=... [TRACEPARENT=00-...] ./emit_refund SUBSCRIPTION_ID AMOUNT_CENTS CURRENCY
 *       REQUEST_KEY
 *
 * TRACEPARENT, when set, is the W3C trace context of the request: it travels with the event as
 * the message header "traceparent", so the consumer's handler can continue the trace.
 *
 * Prints the event id. Exit status: 0 done, 1 failed (nothing committed), 2 usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

#define SQL_RECORD_REFUND                                                                          \
    "INSERT INTO refunds (request_key, subscription_id, amount_cents, currency) "                  \
    "VALUES ($1, $2, $3, $4) ON CONFLICT (request_key) DO NOTHING RETURNING refund_id"
#define SQL_FIND_REFUND                                                                            \
    "SELECT refund_id, subscription_id, amount_cents, currency FROM refunds "                      \
    "WHERE request_key = $1"

/* Runs one parameterized statement; returns its result (PQclear it) or NULL after printing the
 * server's message. */
static PGresult *exec(PGconn *conn, const char *sql, int n, const char *const *params)
{
    PGresult *res = PQexecParams(conn, sql, n, NULL, params, NULL, NULL, 0);
    ExecStatusType st = PQresultStatus(res);
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK)
        return res;
    fprintf(stderr, "emit_refund: %s", PQerrorMessage(conn));
    PQclear(res);
    return NULL;
}

static int command(PGconn *conn, const char *sql)
{
    PGresult *res = exec(conn, sql, 0, NULL);
    if (res == NULL)
        return -1;
    PQclear(res);
    return 0;
}

/* In conn's open transaction: records the refund (or finds the one this request_key recorded
 * before) and queues refund.issued; writes the event id to event_id. 0 or -1. */
static int issue_refund(PGconn *conn, const char *sub, const char *cents, const char *currency,
                        const char *request_key, char event_id[IDEM_UUID_LEN + 1])
{
    const char *params[] = {request_key, sub, cents, currency};
    PGresult *res = exec(conn, SQL_RECORD_REFUND, 4, params);
    if (res == NULL)
        return -1;
    PQclear(res);
    /* The row as stored: a retried request may differ from the first, the first one counts. */
    res = exec(conn, SQL_FIND_REFUND, 1, params);
    if (res == NULL)
        return -1;
    if (PQntuples(res) != 1) {
        fprintf(stderr, "emit_refund: refund %s not found after insert\n", request_key);
        PQclear(res);
        return -1;
    }
    json_t *payload = json_pack("{s:s, s:s, s:I, s:s}", "refund_id", PQgetvalue(res, 0, 0),
                                "subscription_id", PQgetvalue(res, 0, 1), "amount_cents",
                                (json_int_t)strtoll(PQgetvalue(res, 0, 2), NULL, 10), "currency",
                                PQgetvalue(res, 0, 3));
    char key[256];
    snprintf(key, sizeof key, "refund:%s", request_key);
    const char *trace = getenv("TRACEPARENT");
    json_t *headers =
        trace != NULL && trace[0] != '\0' ? json_pack("{s:s}", "traceparent", trace) : NULL;
    idem_error_t err = {0};
    int rc = payload != NULL ? idem_emit_with_headers(conn, "refund.issued", PQgetvalue(res, 0, 1),
                                                      key, payload, headers, event_id, &err)
                             : IDEM_ERR_NOMEM;
    json_decref(headers);
    json_decref(payload);
    PQclear(res);
    if (rc != IDEM_OK) {
        fprintf(stderr, "emit_refund: idem_emit: %s\n", err.text[0] ? err.text : idem_strerror(rc));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    char sub[37];
    char *end;
    if (argc != 5 || !idem_uuid_normalize(argv[1], sub) || strtoll(argv[2], &end, 10) <= 0 ||
        *end != '\0' || strlen(argv[3]) != 3 || strlen(argv[4]) > 200) {
        fprintf(stderr,
                "usage: %s SUBSCRIPTION_ID AMOUNT_CENTS CURRENCY REQUEST_KEY   (IDEM_PG_URL)\n",
                argv[0]);
        return 2;
    }
    const char *url = getenv("IDEM_PG_URL");
    PGconn *conn = PQconnectdb(url != NULL ? url : "");
    if (PQstatus(conn) != CONNECTION_OK) {
        fprintf(stderr, "emit_refund: cannot connect to PostgreSQL: %s", PQerrorMessage(conn));
        PQfinish(conn);
        return 1;
    }
    char event_id[IDEM_UUID_LEN + 1];
    int rc = command(conn, "BEGIN");
    if (rc == 0)
        rc = issue_refund(conn, sub, argv[2], argv[3], argv[4], event_id);
    /* COMMIT makes the refund and its event visible together; a failure rolls back both. */
    if (rc == 0)
        rc = command(conn, "COMMIT");
    else
        command(conn, "ROLLBACK");
    PQfinish(conn);
    if (rc != 0)
        return 1;
    printf("%s\n", event_id);
    return 0;
}
