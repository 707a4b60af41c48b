/* consumer_sql.c - handlers written as SQL functions: `--handler TYPE=SCHEMA.FUNCTION` calls
 * SCHEMA.FUNCTION(event_id, event_type, subscription_id, payload, headers) in the claim's
 * transaction, and the function must exist before anything is consumed. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer_int.h"
#include "event.h"

#define SQL_FUNCTION_EXISTS "SELECT pg_catalog.to_regprocedure($1) IS NOT NULL"
/* The consumer's name belongs to one role (sql/017_narrow_rights.sql): bound to this login role
 * unless it is bound already; a role that is not a member of the name's role is refused. */
#define SQL_CONSUMER_BIND "SELECT idem.idem_consumer_bind($1)"
#define SQL_FUNCTION_USABLE                                                                        \
    "SELECT coalesce(pg_catalog.has_function_privilege(pg_catalog.to_regprocedure($1), "           \
    "'EXECUTE'), false)"

/* ---- SQL handlers ------------------------------------------------------------------------- */

/* An unquoted SQL identifier, folded to lower case as PostgreSQL does. */
static bool ident(const char *s, size_t n, char *out)
{
    if (n == 0 || n > 63 || !(isalpha((unsigned char)s[0]) || s[0] == '_'))
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (!(isalnum(ch) || ch == '_' || ch == '$'))
            return false;
        out[i] = (char)tolower(ch);
    }
    out[n] = '\0';
    return true;
}

static idem_outcome run_sql_handler(idem_event_t *ev, void *userdata)
{
    const sql_handler_t *h = userdata;
    char *payload = json_dumps(idem_event_payload(ev), JSON_COMPACT);
    char *headers = idemp_msg_headers_json(ev->msg);
    if (payload == NULL || headers == NULL) {
        free(payload);
        free(headers);
        return idem_event_fail(ev, IDEM_RETRY, "out of memory");
    }
    const char *params[] = {idem_event_id(ev), idem_event_type(ev), idem_event_subscription(ev),
                            payload, headers};
    idem_outcome o = idem_event_exec(ev, h->call, 5, params, NULL);
    free(payload);
    free(headers);
    return o;
}

int idem_consumer_register_sql(idem_consumer_t *c, const char *event_type, const char *function)
{
    const char *dot = function ? strchr(function, '.') : NULL;
    char schema[64], fn[64];
    if (dot == NULL || !ident(function, (size_t)(dot - function), schema) ||
        !ident(dot + 1, strlen(dot + 1), fn))
        return IDEM_ERR_INVALID;
    sql_handler_t *h = calloc(1, sizeof *h);
    sql_handler_t **list = realloc(c->sql_handlers, (c->nsql_handlers + 1) * sizeof *list);
    if (list != NULL)
        c->sql_handlers = list;
    char call[256], sig[200];
    snprintf(call, sizeof call,
             "SELECT \"%s\".\"%s\"($1::uuid, $2::text, $3::uuid, $4::jsonb, $5::jsonb)", schema,
             fn);
    snprintf(sig, sizeof sig, "\"%s\".\"%s\"(uuid,text,uuid,jsonb,jsonb)", schema, fn);
    if (h == NULL || list == NULL || (h->call = strdup(call)) == NULL ||
        (h->signature = strdup(sig)) == NULL) {
        if (h != NULL) {
            free(h->call);
            free(h);
        }
        return IDEM_ERR_NOMEM;
    }
    c->sql_handlers[c->nsql_handlers++] = h; /* owned by c, freed with it */
    return idemp_registry_add(c->reg, event_type, run_sql_handler, h);
}

/* The database is migrated to what the runtime and the handlers need (idemp_pg_schema_check);
 * every SQL handler's function exists; and is the claim check of the one-round-trip batch there
 * (sql/007_claim_check.sql)? */
int idemp_consumer_check_sql(idem_consumer_t *c, idem_error_t *err)
{
    idemp_rows_t *res = NULL;
    int rc = idemp_pg_schema_check(idemp_pg_conn(c->pg), (const char *const *)c->required, err);
    if (rc == IDEM_ERR_REFUSED)
        rc = IDEM_ERR_NOT_FOUND; /* at start: one line, exit 1 */
    if (rc != IDEM_OK)
        return rc;
    /* the claim's guard and stale rule (sql/008_claim_guard.sql): nothing is claimed without */
    static const char *const needed[] = {"idem.idem_claim_commit(text)",
                                         "idem.idem_stale_before(bigint)",
                                         "idem.idem_claim_check(bigint,integer)"};
    for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++) {
        const char *np[] = {needed[i]};
        rc = idemp_pg_exec(c->pg, SQL_FUNCTION_USABLE, 1, np, &res, err);
        if (rc != IDEM_OK)
            return rc;
        bool ok = idemp_rows_count(res) == 1 && idemp_rows_get(res, 0, 0)[0] == 't';
        idemp_rows_free(res);
        if (i == 2)
            c->claim_check = ok;
        else if (!ok)
            return idem_error_set(err, IDEM_ERR_NOT_FOUND,
                                  "function %s is missing or not executable by this role "
                                  "(run idem migrate, grant the role idem_consumer)",
                                  needed[i]);
    }
    if (!c->claim_check)
        idemp_consumer_log(IDEM_LOG_WARN, c, NULL,
                           "function idem.idem_claim_check is missing or not executable (run "
                           "idem migrate, grant idem_consumer): every batch reads its claim "
                           "before its handlers run, one round trip more");
    /* the ledger takes this role's rows only under the names bound to it */
    const char *bp[] = {c->consumer};
    idem_error_t be = {0};
    rc = idemp_pg_exec(c->pg, SQL_CONSUMER_BIND, 1, bp, NULL, &be);
    if (rc == IDEM_ERR_PG_QUERY)
        return idem_error_set(err, IDEM_ERR_NOT_FOUND, "consumer %s: %s", c->consumer, be.text);
    if (rc != IDEM_OK) {
        if (err != NULL && err->code == 0)
            *err = be;
        return rc;
    }
    for (size_t i = 0; i < idemp_registry_count(c->reg); i++) {
        const idemp_handler_entry_t *e =
            idemp_registry_find(c->reg, idemp_registry_type(c->reg, i));
        if (e->fn != run_sql_handler)
            continue;
        const sql_handler_t *h = e->userdata;
        const char *p[] = {h->signature};
        rc = idemp_pg_exec(c->pg, SQL_FUNCTION_EXISTS, 1, p, &res, err);
        if (rc != IDEM_OK)
            return rc;
        bool ok = idemp_rows_count(res) == 1 && idemp_rows_get(res, 0, 0)[0] == 't';
        idemp_rows_free(res);
        if (!ok)
            return idem_error_set(err, IDEM_ERR_NOT_FOUND,
                                  "handler for %s: function %s does not exist", e->event_type,
                                  h->signature);
    }
    return IDEM_OK;
}
