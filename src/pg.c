/* pg.c - the PostgreSQL adapter. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include <idem/log.h>

#include "backoff.h"
#include "clock.h"
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
    const char *component;
    char where[256];
    PGconn *conn;
    struct prepared prepared[PREPARED_MAX];
    int nprepared;
    int generation;     /* bumps on every connect */
    unsigned next_name; /* prepared statement names are never reused on a connection */
    bool pipeline;      /* in libpq pipeline mode */
    int first_new;      /* prepared entries from here on were queued in this pipeline */
    bool paused;        /* pipeline left early by idemp_pg_pipeline_pause */
    int queued;         /* results not yet read */
    idem_error_t perr;  /* first error of the pipeline */
    char last_tag[16];  /* command tag of the last statement that succeeded */
    idemp_backoff_t backoff;
    int64_t next_ms; /* next connection attempt (monotonic) */
    bool was_up;     /* connected at least once */
    bool failing;    /* the last attempt failed (its reason was logged) */
};

/* ---- rows -------------------------------------------------------------------------------- */

int idemp_rows_count(const idemp_rows_t *r)
{
    return r ? PQntuples((const PGresult *)r) : 0;
}

const char *idemp_rows_get(const idemp_rows_t *r, int row, int col)
{
    return PQgetvalue((const PGresult *)r, row, col);
}

bool idemp_rows_isnull(const idemp_rows_t *r, int row, int col)
{
    return PQgetisnull((const PGresult *)r, row, col) != 0;
}

int64_t idemp_rows_affected(const idemp_rows_t *r)
{
    return r ? strtoll(PQcmdTuples((PGresult *)r), NULL, 10) : 0;
}

void idemp_rows_free(idemp_rows_t *r)
{
    PQclear((PGresult *)r);
}

/* ---- the connection object --------------------------------------------------------------- */

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

idemp_pg_t *idemp_pg_new(const char *conninfo, const char *component)
{
    idemp_pg_t *pg = calloc(1, sizeof *pg);
    if (pg == NULL)
        return NULL;
    pg->conninfo = strdup(conninfo ? conninfo : "");
    if (pg->conninfo == NULL) {
        free(pg);
        return NULL;
    }
    pg->component = component ? component : "postgres";
    idemp_pg_where(pg->conninfo, pg->where, sizeof pg->where);
    idemp_backoff_init(&pg->backoff, 250, 5000);
    return pg;
}

void idemp_pg_set_backoff(idemp_pg_t *pg, int64_t base_ms, int64_t max_ms)
{
    idemp_backoff_init(&pg->backoff, base_ms, max_ms);
}

static void close_conn(idemp_pg_t *pg)
{
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    pg->conn = NULL;
    pg->pipeline = pg->paused = false;
    pg->queued = 0;
    clear_prepared(pg);
}

void idemp_pg_disconnect(idemp_pg_t *pg, const char *reason)
{
    if (pg->conn != NULL && reason != NULL) {
        const char *kv[] = {"server", pg->where, NULL};
        idem_log(IDEM_LOG_WARN, pg->component, kv, "PostgreSQL connection dropped: %s", reason);
    }
    close_conn(pg);
    pg->next_ms = idemp_now_ms();
}

void idemp_pg_free(idemp_pg_t *pg)
{
    if (pg == NULL)
        return;
    close_conn(pg);
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

static int result_error(PGconn *conn, PGresult *res, const char *sql, idem_error_t *err);

/* Keepalive defaults come before the caller's conninfo (expanded from dbname), which wins: a dead
 * peer is noticed in about a minute instead of the kernel's two hours. */
static PGconn *open_conn(const char *conninfo, const char *where, idem_error_t *err)
{
    const char *keys[] = {"connect_timeout",
                          "application_name",
                          "keepalives",
                          "keepalives_idle",
                          "keepalives_interval",
                          "keepalives_count",
                          "tcp_user_timeout",
                          "dbname",
                          NULL};
    const char *vals[] = {"10", "idem", "1", "30", "10", "3", "60000", conninfo, NULL};
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

void idemp_pgconn_close(PGconn *conn)
{
    if (conn != NULL)
        PQfinish(conn);
}

bool idemp_pgconn_ok(PGconn *conn)
{
    return conn != NULL && PQstatus(conn) == CONNECTION_OK;
}

int idemp_pgconn_script(PGconn *conn, const char *sql, const char *what, idem_error_t *err)
{
    if (conn == NULL)
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL");
    PGresult *res = PQexec(conn, sql);
    ExecStatusType st = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
    int rc = IDEM_OK;
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        rc = result_error(conn, res, what, err);
    }
    PQclear(res);
    return rc;
}

int idemp_pg_connect(idemp_pg_t *pg, idem_error_t *err)
{
    close_conn(pg);
    pg->conn = open_conn(pg->conninfo, pg->where, err);
    if (pg->conn == NULL)
        return IDEM_ERR_PG_CONNECT;
    pg->generation++;
    return IDEM_OK;
}

int idemp_pg_ensure(idemp_pg_t *pg, bool *reconnected, idem_error_t *err)
{
    if (reconnected != NULL)
        *reconnected = false;
    if (idemp_pg_connected(pg))
        return IDEM_OK;
    int64_t now = idemp_now_ms();
    if (now < pg->next_ms)
        return idem_error_set(err, IDEM_ERR_PG_CONNECT, "PostgreSQL at %s: waiting to reconnect",
                              pg->where);
    idem_error_t e = {0};
    if (idemp_pg_connect(pg, &e) == IDEM_OK) {
        idemp_backoff_reset(&pg->backoff);
        const char *kv[] = {"server", pg->where, NULL};
        idem_log(IDEM_LOG_INFO, pg->component, kv, "connected to PostgreSQL");
        if (reconnected != NULL)
            *reconnected = pg->was_up;
        pg->was_up = true;
        pg->failing = false;
        return IDEM_OK;
    }
    int64_t wait = idemp_backoff_next(&pg->backoff);
    if (wait < pg->backoff.base_ms)
        wait = pg->backoff.base_ms;
    pg->next_ms = now + wait;
    char w[32];
    snprintf(w, sizeof w, "%lld", (long long)wait);
    const char *kv[] = {"server", pg->where, "retry_in_ms", w, NULL};
    /* the first failure of a run of failures is a warning, the rest repeat it at debug level */
    idem_log(pg->failing ? IDEM_LOG_DEBUG : IDEM_LOG_WARN, pg->component, kv, "%s", e.text);
    pg->failing = true;
    if (err != NULL && err->code == 0)
        *err = e;
    return e.code;
}

int64_t idemp_pg_retry_in_ms(const idemp_pg_t *pg)
{
    if (idemp_pg_connected(pg))
        return 0;
    int64_t left = pg->next_ms - idemp_now_ms();
    return left > 0 ? left : 0;
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

int idemp_pg_socket(const idemp_pg_t *pg)
{
    return idemp_pg_connected(pg) ? PQsocket(pg->conn) : -1;
}

/* ---- results and errors ------------------------------------------------------------------- */

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

static void keep_tag(idemp_pg_t *pg, PGresult *res)
{
    if (pg != NULL)
        snprintf(pg->last_tag, sizeof pg->last_tag, "%s", PQcmdStatus(res));
}

static int check_result(idemp_pg_t *pg, PGconn *conn, PGresult *res, const char *sql,
                        idemp_rows_t **out, idem_error_t *err)
{
    ExecStatusType st = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) {
        keep_tag(pg, res);
        if (out != NULL)
            *out = (idemp_rows_t *)res;
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
                      idemp_rows_t **out, idem_error_t *err)
{
    if (out != NULL)
        *out = NULL;
    if (conn == NULL)
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL");
    PGresult *res = PQexecParams(conn, sql, nparams, NULL, params, NULL, NULL, 0);
    return check_result(NULL, conn, res, sql, out, err);
}

/* A lost connection is dropped at once, so that every caller sees idemp_pg_connected() false. */
static int lost_check(idemp_pg_t *pg, int rc, const idem_error_t *err)
{
    if (rc == IDEM_ERR_PG_LOST)
        idemp_pg_disconnect(pg, err != NULL && err->text[0] ? err->text : "connection lost");
    return rc;
}

/* ---- pipeline mode ------------------------------------------------------------------------ */

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
    } else {
        keep_tag(pg, res);
        if (out != NULL)
            *out = res;
        else
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
                         const char *const *params, idemp_rows_t **out, idem_error_t *err)
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
    PGresult *res = NULL;
    read_queued(pg, sql, &res);
    *out = (idemp_rows_t *)res;
    if (res == NULL) {
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
        return lost_check(pg, pg->perr.code, &pg->perr);
    }
    return IDEM_OK;
}

/* ---- statements -------------------------------------------------------------------------- */

/* The name of sql's prepared statement, preparing it (queued, in pipeline mode) on first use;
 * NULL when it runs unnamed. */
static int prepared_name(idemp_pg_t *pg, const char *sql, int nparams, const char **name,
                         idem_error_t *err)
{
    *name = NULL;
    uint64_t h = fnv1a(sql);
    for (int i = 0; i < pg->nprepared; i++)
        if (pg->prepared[i].hash == h && strcmp(pg->prepared[i].sql, sql) == 0) {
            *name = pg->prepared[i].name;
            return IDEM_OK;
        }
    if (pg->nprepared == PREPARED_MAX)
        return IDEM_OK;
    struct prepared *p = &pg->prepared[pg->nprepared];
    snprintf(p->name, sizeof p->name, "idem_%d_%u", pg->generation, pg->next_name++);
    if (pg->pipeline) {
        /* queued like the rest; a failure surfaces at the end of the pipeline, and the entry is
         * then dropped (names are never reused, so nothing collides) */
        if (!PQsendPrepare(pg->conn, p->name, sql, nparams, NULL))
            return pipeline_send_failed(pg, sql, err);
        pg->queued++;
    } else {
        PGresult *res = PQprepare(pg->conn, p->name, sql, nparams, NULL);
        idem_error_t e = {0};
        int rc = check_result(pg, pg->conn, res, sql, NULL, &e);
        if (rc != IDEM_OK) {
            if (err != NULL && err->code == 0)
                *err = e;
            return lost_check(pg, rc, &e);
        }
    }
    p->sql = strdup(sql);
    p->hash = h;
    if (p->sql == NULL)
        return IDEM_OK; /* runs unnamed */
    pg->nprepared++;
    *name = p->name;
    return IDEM_OK;
}

int idemp_pg_exec(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  idemp_rows_t **out, idem_error_t *err)
{
    if (out != NULL)
        *out = NULL;
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    const char *name;
    int rc = prepared_name(pg, sql, nparams, &name, err);
    if (rc != IDEM_OK)
        return rc;
    if (pg->pipeline)
        return pipeline_exec(pg, sql, name, nparams, params, out, err);
    PGresult *res = name != NULL
                        ? PQexecPrepared(pg->conn, name, nparams, params, NULL, NULL, 0)
                        : PQexecParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    idem_error_t e = {0};
    rc = check_result(pg, pg->conn, res, sql, out, &e);
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    return lost_check(pg, rc, &e);
}

int idemp_pg_pipeline_finish(idemp_pg_t *pg, const char *sql, int nparams,
                             const char *const *params, idemp_rows_t **out, idem_error_t *err)
{
    *out = NULL;
    if (!pg->pipeline)
        return idemp_pg_exec(pg, sql, nparams, params, out, err);
    const char *name;
    int rc = prepared_name(pg, sql, nparams, &name, err);
    if (rc != IDEM_OK)
        return rc;
    int ok = name != NULL ? PQsendQueryPrepared(pg->conn, name, nparams, params, NULL, NULL, 0)
                          : PQsendQueryParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    if (!ok)
        return pipeline_send_failed(pg, sql, err);
    pg->queued++;
    if (!PQpipelineSync(pg->conn)) {
        pipeline_send_failed(pg, sql, err);
        return idemp_pg_pipeline_end(pg, NULL);
    }
    while (pg->queued > 1)
        read_queued(pg, "pipelined statement", NULL);
    PGresult *res = NULL;
    read_queued(pg, sql, &res);
    PGresult *sync = PQgetResult(pg->conn);
    if (sync == NULL || PQresultStatus(sync) != PGRES_PIPELINE_SYNC)
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "pipeline sync lost: %s",
                       PQerrorMessage(pg->conn));
    PQclear(sync);
    pg->queued = 0;
    if (PQstatus(pg->conn) == CONNECTION_OK && !PQexitPipelineMode(pg->conn))
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "cannot leave pipeline mode: %s",
                       PQerrorMessage(pg->conn));
    pg->pipeline = pg->paused = false;
    if (pg->perr.code != 0) {
        PQclear(res);
        for (int i = pg->first_new; i < pg->nprepared; i++)
            free(pg->prepared[i].sql);
        pg->nprepared = pg->first_new;
        if (err != NULL && err->code == 0)
            *err = pg->perr;
        return lost_check(pg, pg->perr.code, &pg->perr);
    }
    *out = (idemp_rows_t *)res;
    return IDEM_OK;
}

int idemp_pg_command(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    if (pg->pipeline)
        return pipeline_exec(pg, sql, NULL, 0, NULL, NULL, err);
    idem_error_t e = {0};
    int rc = check_result(pg, pg->conn, PQexec(pg->conn, sql), sql, NULL, &e);
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    return lost_check(pg, rc, &e);
}

bool idemp_pg_in_transaction(const idemp_pg_t *pg)
{
    if (!idemp_pg_connected(pg))
        return false;
    PGTransactionStatusType t = PQtransactionStatus(pg->conn);
    return t == PQTRANS_INTRANS || t == PQTRANS_INERROR || t == PQTRANS_ACTIVE;
}

int idemp_pg_commit(idemp_pg_t *pg, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    int rc;
    if (pg->pipeline) {
        rc = pipeline_exec(pg, "COMMIT", NULL, 0, NULL, NULL, err);
        if (rc == IDEM_OK)
            rc = idemp_pg_pipeline_end(pg, err); /* the COMMIT's outcome is known here */
    } else {
        /* a pipeline left early (a handler took the bare connection) reports its errors first */
        rc = pg->paused ? idemp_pg_pipeline_end(pg, err) : IDEM_OK;
        if (rc == IDEM_OK && PQtransactionStatus(pg->conn) == PQTRANS_INERROR) {
            /* a statement failed and the caller went on: the server would turn COMMIT into
             * ROLLBACK */
            idemp_pg_rollback(pg);
            return idem_error_set(err, IDEM_ERR_PG_ROLLBACK,
                                  "COMMIT refused: the transaction was aborted by an earlier "
                                  "failed statement (was an error ignored?)");
        }
        if (rc == IDEM_OK)
            rc = idemp_pg_command(pg, "COMMIT", err);
    }
    if (rc != IDEM_OK)
        return rc;
    if (strcmp(pg->last_tag, "COMMIT") != 0)
        return idem_error_set(err, IDEM_ERR_PG_ROLLBACK,
                              "COMMIT answered %s: the transaction was aborted by an earlier "
                              "failed statement (was an error ignored?)",
                              pg->last_tag[0] ? pg->last_tag : "nothing");
    return IDEM_OK;
}

void idemp_pg_rollback(idemp_pg_t *pg)
{
    if (pg->pipeline || pg->paused) {
        idemp_pg_pipeline_pause(pg);
        pg->paused = false;
        if (pg->perr.code == IDEM_ERR_PG_LOST) {
            idemp_pg_disconnect(pg, pg->perr.text);
            return;
        }
    }
    if (!idemp_pg_in_transaction(pg))
        return;
    idem_error_t e = {0};
    if (idemp_pg_command(pg, "ROLLBACK", &e) != IDEM_OK) {
        const char *kv[] = {"server", pg->where, NULL};
        idem_log(IDEM_LOG_DEBUG, pg->component, kv, "%s", e.text);
    }
}

/* ---- LISTEN ------------------------------------------------------------------------------- */

int idemp_pg_listen(idemp_pg_t *pg, const char *channel, idem_error_t *err)
{
    char sql[96];
    snprintf(sql, sizeof sql, "LISTEN %s", channel); /* channel is a constant identifier */
    return idemp_pg_command(pg, sql, err);
}

bool idemp_pg_take_notifies(idemp_pg_t *pg)
{
    if (!idemp_pg_connected(pg) || pg->pipeline)
        return false;
    if (!PQconsumeInput(pg->conn)) {
        char why[300];
        reason(pg->conn, why, sizeof why);
        idemp_pg_disconnect(pg, why);
        return false;
    }
    bool any = false;
    PGnotify *nt;
    while ((nt = PQnotifies(pg->conn)) != NULL) {
        any = true;
        PQfreemem(nt);
    }
    return any;
}

/* ---- array literals ------------------------------------------------------------------------ */

void idemp_pgarray_init(idemp_pgarray_t *a)
{
    memset(a, 0, sizeof *a);
}

static bool reserve(idemp_pgarray_t *a, size_t more)
{
    size_t need = a->len + more + 3; /* the braces and the NUL */
    if (need <= a->cap)
        return true;
    size_t cap = a->cap ? a->cap : 1024;
    while (cap < need)
        cap *= 2;
    char *b = realloc(a->buf, cap);
    if (b == NULL) {
        a->failed = true;
        return false;
    }
    if (a->buf == NULL)
        b[0] = '{';
    a->buf = b;
    a->cap = cap;
    if (a->len == 0)
        a->len = 1;
    return true;
}

void idemp_pgarray_add(idemp_pgarray_t *a, const char *elem)
{
    if (a->failed)
        return;
    size_t l = elem ? strlen(elem) : 0;
    if (!reserve(a, l * 2 + 8))
        return;
    char *p = a->buf + a->len;
    if (a->n > 0)
        *p++ = ',';
    if (elem == NULL) {
        memcpy(p, "NULL", 4);
        p += 4;
    } else {
        *p++ = '"';
        for (const char *s = elem; *s; s++) {
            if (*s == '"' || *s == '\\')
                *p++ = '\\';
            *p++ = *s;
        }
        *p++ = '"';
    }
    a->len = (size_t)(p - a->buf);
    a->n++;
}

const char *idemp_pgarray_str(idemp_pgarray_t *a)
{
    if (a->failed || !reserve(a, 0))
        return NULL;
    a->buf[a->len] = '}';
    a->buf[a->len + 1] = '\0';
    return a->buf;
}

void idemp_pgarray_free(idemp_pgarray_t *a)
{
    free(a->buf);
    idemp_pgarray_init(a);
}
