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
    int generation;          /* bumps on every connect */
    unsigned next_name;      /* prepared statement names are never reused on a connection */
    const char *session_sql; /* run after each connect */
    bool pipeline;           /* in libpq pipeline mode */
    int first_new;           /* prepared entries from here on were queued in this pipeline */
    bool paused;             /* pipeline left early by idemp_pg_pipeline_pause */
    int queued;              /* results not yet read */
    idem_error_t perr;       /* first error of the pipeline */
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

void idemp_pg_set_session_sql(idemp_pg_t *pg, const char *sql)
{
    pg->session_sql = sql;
}

void idemp_pg_disconnect(idemp_pg_t *pg)
{
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    pg->conn = NULL;
    pg->pipeline = pg->paused = false;
    pg->queued = 0;
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

static int check_result(PGconn *conn, PGresult *res, const char *sql, PGresult **out,
                        idem_error_t *err);

int idemp_pg_connect(idemp_pg_t *pg, idem_error_t *err)
{
    idemp_pg_disconnect(pg);
    pg->conn = open_conn(pg->conninfo, pg->where, err);
    if (pg->conn == NULL)
        return IDEM_ERR_PG_CONNECT;
    pg->generation++;
    /* the daemons run short statements on a hot path: JIT compilation would cost more than it
     * saves whenever the planner's estimates on a large outbox cross jit_above_cost */
    PQclear(PQexec(pg->conn, "SET jit = off"));
    if (pg->session_sql != NULL) {
        PGresult *res = PQexec(pg->conn, pg->session_sql);
        int rc = check_result(pg->conn, res, pg->session_sql, NULL, err);
        if (rc != IDEM_OK) {
            idemp_pg_disconnect(pg);
            return rc == IDEM_ERR_PG_LOST ? IDEM_ERR_PG_CONNECT : rc;
        }
    }
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

/* Reads one queued result in pipeline mode; keeps the first error in pg->perr. The result is
 * returned in *out (if non-NULL and the statement succeeded), otherwise cleared. */
static int read_queued(idemp_pg_t *pg, const char *what, PGresult **out)
{
    PGresult *res = PQgetResult(pg->conn);
    pg->queued--;
    if (res == NULL) {
        pg->queued = 0;
        return idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "%s failed: %s", what,
                              PQerrorMessage(pg->conn));
    }
    ExecStatusType st = PQresultStatus(res);
    int rc = IDEM_OK;
    if (st == PGRES_PIPELINE_ABORTED) {
        rc = pg->perr.code ? pg->perr.code : IDEM_ERR_PG_QUERY;
        PQclear(res);
    } else if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        rc = result_error(pg->conn, res, what, &pg->perr);
        PQclear(res);
    } else if (out != NULL) {
        *out = res;
    } else {
        PQclear(res);
    }
    PGresult *end = PQgetResult(pg->conn); /* NULL closes each statement's results */
    if (end != NULL)
        PQclear(end);
    return rc;
}

static int pipeline_send_failed(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "sending %.40s failed: %s", sql,
                   PQerrorMessage(pg->conn));
    return idem_error_set(err, IDEM_ERR_PG_LOST, "%s", pg->perr.text);
}

/* Queues a statement in pipeline mode; with out, reads every queued result up to it. */
static int pipeline_exec(idemp_pg_t *pg, const char *sql, const char *name, int nparams,
                         const char *const *params, PGresult **out, idem_error_t *err)
{
    int ok = name != NULL ? PQsendQueryPrepared(pg->conn, name, nparams, params, NULL, NULL, 0)
                          : PQsendQueryParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    if (!ok)
        return pipeline_send_failed(pg, sql, err);
    pg->queued++;
    if (out == NULL)
        return IDEM_OK;
    if (!PQsendFlushRequest(pg->conn) || PQflush(pg->conn) != 0)
        return pipeline_send_failed(pg, sql, err);
    while (pg->queued > 1)
        read_queued(pg, "pipelined statement", NULL);
    read_queued(pg, sql, out);
    if (*out == NULL) {
        idem_error_set(&pg->perr, IDEM_ERR_PG_QUERY, "statement skipped after an earlier error");
        if (err != NULL && err->code == 0)
            *err = pg->perr;
        return pg->perr.code;
    }
    return IDEM_OK;
}

int idemp_pg_pipeline_begin(idemp_pg_t *pg, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    if (!PQenterPipelineMode(pg->conn))
        return idem_error_set(err, IDEM_ERR_PG_QUERY, "cannot enter pipeline mode: %s",
                              PQerrorMessage(pg->conn));
    memset(&pg->perr, 0, sizeof pg->perr);
    pg->pipeline = true;
    pg->paused = false;
    pg->queued = 0;
    pg->first_new = pg->nprepared;
    return IDEM_OK;
}

void idemp_pg_pipeline_pause(idemp_pg_t *pg)
{
    if (!pg->pipeline || pg->conn == NULL)
        return;
    if (!PQpipelineSync(pg->conn)) {
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "pipeline sync failed: %s",
                       PQerrorMessage(pg->conn));
    } else {
        while (pg->queued > 0)
            read_queued(pg, "pipelined statement", NULL);
        PGresult *res = PQgetResult(pg->conn);
        if (res == NULL || PQresultStatus(res) != PGRES_PIPELINE_SYNC)
            idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "pipeline sync lost: %s",
                           PQerrorMessage(pg->conn));
        PQclear(res);
    }
    if (PQstatus(pg->conn) == CONNECTION_OK && !PQexitPipelineMode(pg->conn))
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "cannot leave pipeline mode: %s",
                       PQerrorMessage(pg->conn));
    if (PQstatus(pg->conn) != CONNECTION_OK && pg->perr.code != 0)
        pg->perr.code = IDEM_ERR_PG_LOST;
    pg->pipeline = false;
    pg->paused = true;
    pg->queued = 0;
    if (pg->perr.code != 0) {
        /* a queued PREPARE may not have happened: forget what this pipeline prepared */
        for (int i = pg->first_new; i < pg->nprepared; i++)
            free(pg->prepared[i].sql);
        pg->nprepared = pg->first_new;
    }
}

int idemp_pg_pipeline_end(idemp_pg_t *pg, idem_error_t *err)
{
    if (!pg->pipeline && !pg->paused)
        return IDEM_OK;
    idemp_pg_pipeline_pause(pg);
    pg->paused = false;
    if (pg->perr.code != 0) {
        if (err != NULL && err->code == 0)
            *err = pg->perr;
        return pg->perr.code;
    }
    return IDEM_OK;
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
        snprintf(p->name, sizeof p->name, "idem_%d_%u", pg->generation, pg->next_name++);
        if (pg->pipeline) {
            /* queued like the rest; a failure surfaces at the end of the pipeline, and the
             * entry is then dropped (names are never reused, so nothing collides) */
            if (!PQsendPrepare(pg->conn, p->name, sql, nparams, NULL))
                return pipeline_send_failed(pg, sql, err);
            pg->queued++;
        } else {
            PGresult *res = PQprepare(pg->conn, p->name, sql, nparams, NULL);
            int rc = check_result(pg->conn, res, sql, NULL, err);
            if (rc != IDEM_OK)
                return rc;
        }
        p->sql = strdup(sql);
        p->hash = h;
        if (p->sql == NULL)
            p = NULL; /* falls back to an unnamed statement */
        else
            pg->nprepared++;
    }
    if (pg->pipeline)
        return pipeline_exec(pg, sql, p ? p->name : NULL, nparams, params, out, err);
    PGresult *res = p != NULL ? PQexecPrepared(pg->conn, p->name, nparams, params, NULL, NULL, 0)
                              : PQexecParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    return check_result(pg->conn, res, sql, out, err);
}

int idemp_pg_command(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    if (pg->pipeline)
        return pipeline_exec(pg, sql, NULL, 0, NULL, NULL, err);
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
