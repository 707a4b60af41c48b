/* pg_async.c - pipelines sent without waiting: statements queued, sent with a sync, and their
 * results read as they arrive, so that one loop can drive several connections and a broker link
 * at once (the relay). The first error is kept, as in pg_pipeline.c. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_int.h"

static void note_sql(idemp_pg_t *pg, const char *sql)
{
    if (pg->queued < IDEMP_PIPE_MAX)
        pg->qsql[pg->queued] = sql;
}

int idemp_pg_queue(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                   bool keep, idem_error_t *err)
{
    if (!pg->pipeline || pg->sent)
        return idem_error_set(err, IDEM_ERR_INVALID, "no pipeline open for %.40s", sql);
    const char *name;
    int rc = idemp_pg_prepared_name(pg, sql, nparams, &name, err);
    if (rc != IDEM_OK)
        return rc;
    if (keep) {
        if (pg->queued >= IDEMP_PIPE_MAX || pg->nkept >= IDEMP_PIPE_KEPT_MAX)
            return idem_error_set(err, IDEM_ERR_INVALID, "pipeline too long for %.40s", sql);
        pg->keep_mask |= 1u << pg->queued;
        pg->nkept++;
    }
    note_sql(pg, sql);
    return idemp_pg_pipeline_exec(pg, sql, name, nparams, params, NULL, err);
}

int idemp_pg_queue_command(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    if (!pg->pipeline || pg->sent)
        return idem_error_set(err, IDEM_ERR_INVALID, "no pipeline open for %.40s", sql);
    note_sql(pg, sql);
    return idemp_pg_pipeline_exec(pg, sql, NULL, 0, NULL, NULL, err);
}

int idemp_pg_queue_commit(idemp_pg_t *pg, idem_error_t *err)
{
    if (pg->pipeline && !pg->sent && pg->queued < IDEMP_PIPE_MAX)
        pg->commit_at = pg->queued;
    return idemp_pg_queue_command(pg, "COMMIT", err);
}

static int finish(idemp_pg_t *pg, idemp_rows_t **out, int nout, idem_error_t *err);

int idemp_pg_pipeline_send(idemp_pg_t *pg, idem_error_t *err)
{
    if (!pg->pipeline || pg->sent)
        return idem_error_set(err, IDEM_ERR_INVALID, "no pipeline to send");
    pg->sent = true;
    pg->nread = 0;
    if (pg->perr.code == 0 && !PQpipelineSync(pg->conn))
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "sending the pipeline failed: %s",
                       PQerrorMessage(pg->conn));
    if (pg->perr.code != 0) {
        /* a send failed: the connection is gone, and nothing will be answered */
        pg->perr.code = IDEM_ERR_PG_LOST;
        return finish(pg, NULL, 0, err);
    }
    return IDEM_OK;
}

bool idemp_pg_pipeline_sent(const idemp_pg_t *pg)
{
    return pg->sent;
}

bool idemp_pg_pipeline_open(const idemp_pg_t *pg)
{
    return pg->pipeline && !pg->sent && pg->conn != NULL;
}

/* The pipeline is over (its sync arrived, or the connection is gone): leaves pipeline mode and
 * hands back the outcome. */
static int finish(idemp_pg_t *pg, idemp_rows_t **out, int nout, idem_error_t *err)
{
    if (PQstatus(pg->conn) == CONNECTION_OK && !PQexitPipelineMode(pg->conn))
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "cannot leave pipeline mode: %s",
                       PQerrorMessage(pg->conn));
    if (PQstatus(pg->conn) != CONNECTION_OK && pg->perr.code != 0)
        pg->perr.code = IDEM_ERR_PG_LOST;
    pg->pipeline = pg->paused = pg->sent = false;
    pg->queued = 0;
    pg->keep_mask = 0;
    pg->commit_at = -1;
    int nkept = pg->nkept;
    pg->nkept = 0;
    if (pg->perr.code != 0) {
        for (int i = 0; i < nkept; i++) {
            PQclear(pg->kept[i]);
            pg->kept[i] = NULL;
        }
        /* a queued PREPARE may not have happened: forget what this pipeline prepared */
        for (int i = pg->first_new; i < pg->nprepared; i++)
            free(pg->prepared[i].sql);
        pg->nprepared = pg->first_new;
        if (err != NULL && err->code == 0)
            *err = pg->perr;
        return idemp_pg_lost_check(pg, pg->perr.code, &pg->perr);
    }
    for (int i = 0; i < nkept; i++) {
        if (i < nout && out != NULL)
            out[i] = (idemp_rows_t *)pg->kept[i];
        else
            PQclear(pg->kept[i]);
        pg->kept[i] = NULL;
    }
    return IDEM_OK;
}

/* One result of a statement of the pipeline: the first error is kept; a kept result is stored. */
static void take(idemp_pg_t *pg, PGresult *res)
{
    int i = pg->nread++;
    pg->queued--;
    const char *what = i < IDEMP_PIPE_MAX && pg->qsql[i] ? pg->qsql[i] : "pipelined statement";
    ExecStatusType st = PQresultStatus(res);
    if (st == PGRES_PIPELINE_ABORTED) {
        if (pg->perr.code == 0)
            idem_error_set(&pg->perr, IDEM_ERR_PG_QUERY, "%.40s skipped after an earlier error",
                           what);
        PQclear(res);
        return;
    }
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        idemp_pg_result_error(pg->conn, res, what, &pg->perr);
        PQclear(res);
        return;
    }
    idemp_pg_keep_tag(pg, res);
    if (i == pg->commit_at && strcmp(pg->last_tag, "COMMIT") != 0)
        idem_error_set(&pg->perr, IDEM_ERR_PG_ROLLBACK,
                       "COMMIT answered %s: the transaction was aborted by an earlier failed "
                       "statement",
                       pg->last_tag[0] ? pg->last_tag : "nothing");
    int k = 0;
    for (int j = 0; j < i && j < IDEMP_PIPE_MAX; j++)
        k += (pg->keep_mask >> j) & 1u;
    if (i < IDEMP_PIPE_MAX && ((pg->keep_mask >> i) & 1u) && k < IDEMP_PIPE_KEPT_MAX)
        pg->kept[k] = res;
    else
        PQclear(res);
}

int idemp_pg_pipeline_poll(idemp_pg_t *pg, bool *done, idemp_rows_t **out, int nout,
                           idem_error_t *err)
{
    *done = !pg->sent;
    if (!pg->sent) /* never sent, or its connection was dropped meanwhile */
        return idem_error_set(err, IDEM_ERR_PG_LOST, "no pipeline in flight on PostgreSQL at %s",
                              pg->where);
    if (PQstatus(pg->conn) != CONNECTION_OK || !PQconsumeInput(pg->conn)) {
        idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "connection lost: %s",
                       PQerrorMessage(pg->conn));
        *done = true;
        return finish(pg, out, nout, err);
    }
    int nulls = 0;
    while (!PQisBusy(pg->conn)) {
        PGresult *res = PQgetResult(pg->conn);
        if (res == NULL) {
            /* one NULL ends each statement's results; two in a row: nothing more will come */
            if (PQstatus(pg->conn) != CONNECTION_OK || ++nulls > 1) {
                idem_error_set(&pg->perr, IDEM_ERR_PG_LOST, "pipeline ended without its sync: %s",
                               PQerrorMessage(pg->conn));
                *done = true;
                return finish(pg, out, nout, err);
            }
            continue;
        }
        nulls = 0;
        if (PQresultStatus(res) == PGRES_PIPELINE_SYNC) {
            PQclear(res);
            *done = true;
            return finish(pg, out, nout, err);
        }
        take(pg, res);
    }
    return IDEM_OK;
}

int idemp_pg_pipeline_wait(idemp_pg_t *pg, idemp_rows_t **out, int nout, idem_error_t *err)
{
    for (;;) {
        bool done = false;
        int rc = idemp_pg_pipeline_poll(pg, &done, out, nout, err);
        if (done || !pg->sent)
            return rc;
        struct pollfd pfd = {PQsocket(pg->conn), POLLIN, 0};
        poll(&pfd, 1, 1000);
    }
}
