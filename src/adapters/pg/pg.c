/* pg.c - the PostgreSQL adapter: the connection object (connect, reconnect with backoff, the reason
 * of every disconnect), results sorted into errors, prepared statements, notifications taken.
 * Running statements is pg_exec.c. */
#include <stdint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <libpq-fe.h>

#include <idem/log.h>

#include "backoff.h"
#include "clock.h"
#include "mask.h"
#include "host.h"
#include "pg_int.h"

/* A connection that stayed up this long resets the reconnect backoff when it drops. */
#define STABLE_MS 10000

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
    pg->pipeline = pg->paused = pg->sent = false;
    pg->queued = 0;
    for (int i = 0; i < pg->nkept; i++)
        PQclear(pg->kept[i]);
    pg->nkept = 0;
    pg->keep_mask = 0;
    clear_prepared(pg);
}

void idemp_pg_disconnect(idemp_pg_t *pg, const char *reason)
{
    if (pg->conn != NULL && reason != NULL) {
        const char *kv[] = {"server", pg->where, NULL};
        idem_log(IDEM_LOG_WARN, pg->component, kv, "PostgreSQL connection dropped: %s", reason);
    }
    bool was_connected = pg->conn != NULL;
    close_conn(pg);
    int64_t now = idemp_now_ms();
    if (was_connected && now - pg->connected_at >= STABLE_MS) {
        idemp_backoff_reset(&pg->backoff); /* it had been up a while: try again at once */
        pg->next_ms = now;
    } else if (was_connected) {
        /* it went down soon after coming up: keep backing off, not reconnect in a loop */
        int64_t wait = idemp_backoff_next(&pg->backoff);
        pg->next_ms = now + (wait < pg->backoff.base_ms ? pg->backoff.base_ms : wait);
    }
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

/* libpq's conninfo parse errors quote a word of the string ('missing "=" after "X"', 'invalid
 * connection option "X"'): after an unquoted password with a blank in it, that word is the rest
 * of the password. Where the string names a password, the word is not shown. */
static void hide_quoted_word(const char *conninfo, char *msg)
{
    if (strstr(conninfo, "password") == NULL)
        return;
    static const char *const after[] = {"after \"", "option \""};
    for (size_t i = 0; i < sizeof after / sizeof after[0]; i++) {
        char *w = strstr(msg, after[i]);
        if (w == NULL)
            continue;
        w += strlen(after[i]);
        char *end = strchr(w, '"');
        if (end == NULL || end - w < 3)
            continue;
        memcpy(w, "***", 3);
        memmove(w + 3, end, strlen(end) + 1);
    }
}

/* Server notices (e.g. "relation already exists, skipping") are not errors: debug log only,
 * except idem's own (a migration that could not create a role says so). */
static void on_notice(void *arg, const char *message)
{
    const char *own = strstr(message, "idem: ");
    if (own != NULL)
        idem_log(IDEM_LOG_WARN, "postgres", NULL, "%s", own);
    else
        idem_log(IDEM_LOG_DEBUG, "postgres", NULL, "%s", message);
}

int idemp_pg_result_error(PGconn *conn, PGresult *res, const char *sql, idem_error_t *err);

/* Keepalive defaults come before the caller's conninfo (expanded from dbname), which wins: a dead
 * peer is noticed in about a minute instead of the kernel's two hours. A daemon's connections are
 * named "idem COMPONENT pid N" unless the conninfo names them, so that an operator (and `idem
 * status`, for the rows a relay holds) can tell which process a server session belongs to. */
static PGconn *open_conn(const char *conninfo, const char *where, const char *component,
                         idem_error_t *err)
{
    char app[64] = "idem";
    if (component != NULL)
        snprintf(app, sizeof app, "idem %s pid %ld", component, (long)getpid());
    /* libpq takes raw blanks and control characters inside a URI; where a password holding one
     * ends could not be told when a line shows the URI, so idem refuses them (percent-encode) */
    if (strncmp(conninfo, "postgres://", 11) == 0 || strncmp(conninfo, "postgresql://", 13) == 0)
        for (const unsigned char *b = (const unsigned char *)conninfo; *b != '\0'; b++)
            if (*b <= 0x20 || *b == 0x7f) {
                idem_error_set(err, IDEM_ERR_PG_CONNECT,
                               "invalid PostgreSQL URI: a blank or control character in it must "
                               "be percent-encoded (%%20)");
                return NULL;
            }
    if (idemp_pg_uri_ambiguous(conninfo)) {
        idem_error_set(err, IDEM_ERR_PG_CONNECT,
                       "invalid PostgreSQL URI: \"://\" past its scheme or an '@' after its "
                       "host (a password holding '@', '/' or ':' must be percent-encoded, %%40 "
                       "%%2F %%3A)");
        return NULL;
    }
    const char *keys[] = {"connect_timeout",
                          "fallback_application_name",
                          "keepalives",
                          "keepalives_idle",
                          "keepalives_interval",
                          "keepalives_count",
                          "tcp_user_timeout",
                          "dbname",
                          NULL};
    const char *vals[] = {"10", app, "1", "30", "10", "3", "60000", conninfo, NULL};
    PGconn *conn = PQconnectdbParams(keys, vals, 1);
    if (conn == NULL || PQstatus(conn) != CONNECTION_OK) {
        char why[400];
        reason(conn, why, sizeof why);
        hide_quoted_word(conninfo, why);
        idem_error_set(err, IDEM_ERR_PG_CONNECT, "cannot connect to PostgreSQL at %s: %s", where,
                       why);
        if (conn != NULL)
            PQfinish(conn);
        return NULL;
    }
    PQsetNoticeProcessor(conn, on_notice, NULL);
    return conn;
}

/* sslmode=prefer (libpq's default) falls back to plain TCP without a word: a link without TLS to
 * a host that is not loopback is logged as a warning. */
static bool plain_remote(PGconn *conn)
{
    return !PQsslInUse(conn) && !idemp_host_loopback(PQhost(conn));
}

static void warn_plain(PGconn *conn, const char *component)
{
    char at[300];
    snprintf(at, sizeof at, "%s:%s", PQhost(conn), PQport(conn));
    const char *kv[] = {"server", at, "tls", "off", NULL};
    idem_log(IDEM_LOG_WARN, component, kv,
             "connected to PostgreSQL without TLS (tls=off) on a host that is not loopback: the "
             "password and every statement cross the network in clear (use sslmode=verify-full)");
}

PGconn *idemp_pg_connect_once(const char *conninfo, idem_error_t *err)
{
    /* once per process: the console connects for each request */
    static atomic_bool warned;
    char where[256];
    idemp_pg_where(conninfo ? conninfo : "", where, sizeof where);
    PGconn *conn = open_conn(conninfo ? conninfo : "", where, NULL, err);
    if (conn != NULL && plain_remote(conn) && !atomic_exchange(&warned, true))
        warn_plain(conn, "postgres");
    return conn;
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
        idem_error_t e = {0};
        rc = idemp_pg_result_error(conn, res, what, &e);
        /* the whole of what names the script ("migration 004_x.sql failed: ...") */
        const char *msg = res ? PQresultErrorMessage(res) : "";
        if (err != NULL && err->code == 0) {
            *err = e;
            if (msg != NULL && *msg != '\0') {
                err->code = 0;
                idem_error_set(err, rc, "%s failed: %s", what, msg);
            }
        }
    }
    PQclear(res);
    return rc;
}

int idemp_pg_connect(idemp_pg_t *pg, idem_error_t *err)
{
    close_conn(pg);
    pg->conn = open_conn(pg->conninfo, pg->where, pg->component, err);
    if (pg->conn == NULL)
        return IDEM_ERR_PG_CONNECT;
    if (!pg->warned_plain && plain_remote(pg->conn)) {
        pg->warned_plain = true;
        warn_plain(pg->conn, pg->component);
    }
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
        pg->connected_at = now;
        char at[300];
        snprintf(at, sizeof at, "%s:%s", PQhost(pg->conn), PQport(pg->conn));
        const char *kv[] = {"server", at, "tls", PQsslInUse(pg->conn) ? "on" : "off", NULL};
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

int idemp_pg_backend_pid(const idemp_pg_t *pg)
{
    return idemp_pg_connected(pg) ? PQbackendPID(pg->conn) : 0;
}

/* ---- results and errors ------------------------------------------------------------------- */

/* Sorts a failed result into query error or lost connection and fills err. */
int idemp_pg_result_error(PGconn *conn, PGresult *res, const char *sql, idem_error_t *err)
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

void idemp_pg_keep_tag(idemp_pg_t *pg, PGresult *res)
{
    if (pg != NULL)
        snprintf(pg->last_tag, sizeof pg->last_tag, "%s", PQcmdStatus(res));
}

int idemp_pg_check_result(idemp_pg_t *pg, PGconn *conn, PGresult *res, const char *sql,
                          idemp_rows_t **out, idem_error_t *err)
{
    ExecStatusType st = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) {
        idemp_pg_keep_tag(pg, res);
        if (out != NULL)
            *out = (idemp_rows_t *)res;
        else
            PQclear(res);
        return IDEM_OK;
    }
    int rc = idemp_pg_result_error(conn, res, sql, err);
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
    return idemp_pg_check_result(NULL, conn, res, sql, out, err);
}

/* A lost connection is dropped at once, so that every caller sees idemp_pg_connected() false. */
int idemp_pg_lost_check(idemp_pg_t *pg, int rc, const idem_error_t *err)
{
    if (rc == IDEM_ERR_PG_LOST)
        idemp_pg_disconnect(pg, err != NULL && err->text[0] ? err->text : "connection lost");
    return rc;
}

/* ---- prepared statements ----------------------------------------------------------------- */

int idemp_pg_send_failed(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "sending %.40s failed: %s", sql,
                   PQerrorMessage(pg->conn));
    return idem_error_set(err, IDEM_ERR_PG_LOST, "%s", pg->perr.text);
}

/* The name of sql's prepared statement, preparing it (queued, in pipeline mode) on first use;
 * NULL when it runs unnamed. */
int idemp_pg_prepared_name(idemp_pg_t *pg, const char *sql, int nparams, const char **name,
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
            return idemp_pg_send_failed(pg, sql, err);
        if (pg->queued < IDEMP_PIPE_MAX)
            pg->qsql[pg->queued] = sql;
        pg->queued++;
    } else {
        PGresult *res = PQprepare(pg->conn, p->name, sql, nparams, NULL);
        idem_error_t e = {0};
        int rc = idemp_pg_check_result(pg, pg->conn, res, sql, NULL, &e);
        if (rc != IDEM_OK) {
            if (err != NULL && err->code == 0)
                *err = e;
            return idemp_pg_lost_check(pg, rc, &e);
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

/* ---- LISTEN ------------------------------------------------------------------------------- */

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
