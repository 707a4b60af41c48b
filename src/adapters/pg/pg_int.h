/* pg_int.h - what the files of the PostgreSQL adapter share (pg.c: connections, results,
 * prepared statements; pg_pipeline.c and pg_async.c: pipeline mode; pg_exec.c: statements).
 * Not for other modules. */
#ifndef IDEM_PG_INT_H
#define IDEM_PG_INT_H

#include <libpq-fe.h>

#include "backoff.h"
#include "pg.h"

#define PREPARED_MAX 64
#define IDEMP_PIPE_MAX 32     /* statements of an asynchronous pipeline (pg_async.c) */
#define IDEMP_PIPE_KEPT_MAX 4 /* results it hands back */

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
    /* an asynchronous pipeline (pg_async.c): sent, its results read as they arrive */
    bool sent;                           /* sent with its sync, not yet fully answered */
    int nread;                           /* results read since it was sent */
    const char *qsql[IDEMP_PIPE_MAX];    /* each queued statement's SQL, for messages */
    uint32_t keep_mask;                  /* statements whose results are handed back */
    int nkept;                           /* how many */
    PGresult *kept[IDEMP_PIPE_KEPT_MAX]; /* those results, in order */
    int commit_at;                       /* index of a checked COMMIT, or -1 */
    idemp_backoff_t backoff;
    int64_t next_ms;      /* next connection attempt (monotonic) */
    bool was_up;          /* connected at least once */
    bool warned_plain;    /* the tls=off warning (a host that is not loopback) was logged */
    int64_t connected_at; /* monotonic ms of the last successful connect */
    bool failing;         /* the last attempt failed (its reason was logged) */
};

/* Sorts a failed result into query error or lost connection and fills err. */
int idemp_pg_result_error(PGconn *conn, PGresult *res, const char *sql, idem_error_t *err);
/* Remembers the command tag of a successful result (COMMIT or ROLLBACK). */
void idemp_pg_keep_tag(idemp_pg_t *pg, PGresult *res);
/* IDEM_OK with the rows in *out (or cleared), or the failure sorted into err. */
int idemp_pg_check_result(idemp_pg_t *pg, PGconn *conn, PGresult *res, const char *sql,
                          idemp_rows_t **out, idem_error_t *err);
/* A lost connection is dropped at once, so that every caller sees it down; returns rc. */
int idemp_pg_lost_check(idemp_pg_t *pg, int rc, const idem_error_t *err);
/* The name of sql's prepared statement, preparing it (queued in pipeline mode) on first use;
 * NULL when it runs unnamed. */
int idemp_pg_prepared_name(idemp_pg_t *pg, const char *sql, int nparams, const char **name,
                           idem_error_t *err);
/* A send in pipeline mode failed: the connection is gone; keeps and returns the error. */
int idemp_pg_send_failed(idemp_pg_t *pg, const char *sql, idem_error_t *err);
/* Reads one queued result in pipeline mode, keeping the first error; *out (optional) gets the
 * result of a statement that succeeded. */
int idemp_pg_read_queued(idemp_pg_t *pg, const char *what, PGresult **out);
/* Queues a statement in pipeline mode; with out, reads every queued result up to it. */
int idemp_pg_pipeline_exec(idemp_pg_t *pg, const char *sql, const char *name, int nparams,
                           const char *const *params, idemp_rows_t **out, idem_error_t *err);

#endif
