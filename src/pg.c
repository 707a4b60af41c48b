/* pg.c - the PostgreSQL adapter. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "mask.h"
#include "pg.h"

#define PREPARED_MAX 64

struct prepared {
    uint64_t hash;
    char *sql;
    char name[24];
};

struct idemp_pg {
    char *conninfo;
    char where[256];
    PGconn *conn;
    struct prepared prepared[PREPARED_MAX];
    int nprepared;
    int generation; /* bumps on every connect, names prepared statements uniquely */
};

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static void clear_prepared(idemp_pg_t *pg)
{
    for (int i = 0; i < pg->nprepared; i++)
        free(pg->prepared[i].sql);
    pg->nprepared = 0;
}

idemp_pg_t *idemp_pg_new(const char *conninfo)
{
    idemp_pg_t *pg = calloc(1, sizeof *pg);
    if (pg == NULL)
        return NULL;
    pg->conninfo = strdup(conninfo ? conninfo : "");
    if (pg->conninfo == NULL) {
        free(pg);
        return NULL;
    }
    idemp_pg_where(pg->conninfo, pg->where, sizeof pg->where);
    return pg;
}

void idemp_pg_disconnect(idemp_pg_t *pg)
{
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    pg->conn = NULL;
    clear_prepared(pg);
}

void idemp_pg_free(idemp_pg_t *pg)
{
    if (pg == NULL)
        return;
    idemp_pg_disconnect(pg);
    free(pg->conninfo);
    free(pg);
}

/* PQerrorMessage as one line without the "connection to server ... failed:" preamble. */
static void reason(PGconn *conn, char *out, size_t sz)
{
    const char *m = conn ? PQerrorMessage(conn) : "out of memory";
    const char *f = strstr(m, " failed: ");
    if (f != NULL && strncmp(m, "connection to server", 20) == 0)
        m = f + 9;
    size_t o = 0;
    for (; *m && o + 1 < sz; m++) {
        char ch = (*m == '\n' || *m == '\t' || *m == '\r') ? ' ' : *m;
        if (ch == ' ' && (o == 0 || out[o - 1] == ' '))
            continue;
        out[o++] = ch;
    }
    while (o > 0 && out[o - 1] == ' ')
        o--;
    out[o] = '\0';
}

/* Server notices (e.g. "relation already exists, skipping") are not errors: debug log only. */
static void on_notice(void *arg, const char *message)
{
    idem_log(IDEM_LOG_DEBUG, "postgres", NULL, "%s", message);
}

static PGconn *open_conn(const char *conninfo, const char *where, idem_error_t *err)
{
    const char *keys[] = {"connect_timeout", "application_name", "dbname", NULL};
    const char *vals[] = {"10", "idem", conninfo, NULL};
    PGconn *conn = PQconnectdbParams(keys, vals, 1);
    if (conn == NULL || PQstatus(conn) != CONNECTION_OK) {
        char why[400];
        reason(conn, why, sizeof why);
        idem_error_set(err, IDEM_ERR_PG_CONNECT, "cannot connect to PostgreSQL at %s: %s", where,
                       why);
        if (conn != NULL)
            PQfinish(conn);
        return NULL;
    }
    PQsetNoticeProcessor(conn, on_notice, NULL);
    return conn;
}

PGconn *idemp_pg_connect_once(const char *conninfo, idem_error_t *err)
{
    char where[256];
    idemp_pg_where(conninfo ? conninfo : "", where, sizeof where);
    return open_conn(conninfo ? conninfo : "", where, err);
}

int idemp_pg_connect(idemp_pg_t *pg, idem_error_t *err)
{
    idemp_pg_disconnect(pg);
    pg->conn = open_conn(pg->conninfo, pg->where, err);
    if (pg->conn == NULL)
        return IDEM_ERR_PG_CONNECT;
    pg->generation++;
    return IDEM_OK;
}

bool idemp_pg_connected(const idemp_pg_t *pg)
{
    return pg->conn != NULL && PQstatus(pg->conn) == CONNECTION_OK;
}

PGconn *idemp_pg_conn(idemp_pg_t *pg)
{
    return idemp_pg_connected(pg) ? pg->conn : NULL;
}

const char *idemp_pg_where_str(const idemp_pg_t *pg)
{
    return pg->where;
}

/* Sorts a failed result into query error or lost connection and fills err. */
static int result_error(PGconn *conn, PGresult *res, const char *sql, idem_error_t *err)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *msg = res ? PQresultErrorMessage(res) : "";
    if (msg == NULL || *msg == '\0')
        msg = PQerrorMessage(conn);
    bool lost = PQstatus(conn) != CONNECTION_OK || state == NULL ||
                (state != NULL && strncmp(state, "08", 2) == 0) ||
                (state != NULL && strncmp(state, "57P", 3) == 0 && strcmp(state, "57P03") != 0);
    char verb[32];
    snprintf(verb, sizeof verb, "%.*s", (int)strcspn(sql, " \n("), sql);
    int code = lost ? IDEM_ERR_PG_LOST : IDEM_ERR_PG_QUERY;
    idem_error_set(err, code, "%s failed: %s", verb, msg);
    if (err != NULL && err->code == code && state != NULL)
        snprintf(err->sqlstate, sizeof err->sqlstate, "%s", state);
    return code;
}

static int check_result(PGconn *conn, PGresult *res, const char *sql, PGresult **out,
                        idem_error_t *err)
{
    ExecStatusType st = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) {
        if (out != NULL)
            *out = res;
        else
            PQclear(res);
        return IDEM_OK;
    }
    int rc = result_error(conn, res, sql, err);
    PQclear(res);
    if (out != NULL)
        *out = NULL;
    return rc;
}

int idemp_pgconn_exec(PGconn *conn, const char *sql, int nparams, const char *const *params,
                      PGresult **out, idem_error_t *err)
{
    if (out != NULL)
        *out = NULL;
    if (conn == NULL)
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL");
    PGresult *res = PQexecParams(conn, sql, nparams, NULL, params, NULL, NULL, 0);
    return check_result(conn, res, sql, out, err);
}

int idemp_pg_exec(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  PGresult **out, idem_error_t *err)
{
    if (out != NULL)
        *out = NULL;
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    uint64_t h = fnv1a(sql);
    struct prepared *p = NULL;
    for (int i = 0; i < pg->nprepared; i++)
        if (pg->prepared[i].hash == h && strcmp(pg->prepared[i].sql, sql) == 0) {
            p = &pg->prepared[i];
            break;
        }
    if (p == NULL && pg->nprepared < PREPARED_MAX) {
        p = &pg->prepared[pg->nprepared];
        snprintf(p->name, sizeof p->name, "idem_%d_%d", pg->generation, pg->nprepared);
        PGresult *res = PQprepare(pg->conn, p->name, sql, nparams, NULL);
        int rc = check_result(pg->conn, res, sql, NULL, err);
        if (rc != IDEM_OK)
            return rc;
        p->sql = strdup(sql);
        p->hash = h;
        if (p->sql == NULL)
            p = NULL; /* falls back to an unnamed statement */
        else
            pg->nprepared++;
    }
    PGresult *res = p != NULL
                        ? PQexecPrepared(pg->conn, p->name, nparams, params, NULL, NULL, 0)
                        : PQexecParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    return check_result(pg->conn, res, sql, out, err);
}

int idemp_pg_command(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    return check_result(pg->conn, PQexec(pg->conn, sql), sql, NULL, err);
}

bool idemp_pg_is_transient(const idem_error_t *err)
{
    if (err == NULL)
        return false;
    if (err->code == IDEM_ERR_PG_LOST)
        return true;
    static const char *const states[] = {"40001", "40P01", "55P03", "57014"};
    for (size_t i = 0; i < sizeof states / sizeof states[0]; i++)
        if (strcmp(err->sqlstate, states[i]) == 0)
            return true;
    return false;
}
