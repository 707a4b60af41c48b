/* pg_pipeline.c - libpq's pipeline mode: statements queued and their results read in one round
 * trip, the first error kept for the end of the pipeline. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_int.h"

/* ---- pipeline mode ------------------------------------------------------------------------ */

/* Reads one queued result in pipeline mode; keeps the first error in pg->perr. The result is
 * returned in *out (if non-NULL and the statement succeeded), otherwise cleared. */
int idemp_pg_read_queued(idemp_pg_t *pg, const char *what, PGresult **out)
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
        rc = idemp_pg_result_error(pg->conn, res, what, &pg->perr);
        PQclear(res);
    } else {
        idemp_pg_keep_tag(pg, res);
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

/* Queues a statement in pipeline mode; with out, reads every queued result up to it. */
int idemp_pg_pipeline_exec(idemp_pg_t *pg, const char *sql, const char *name, int nparams,
                           const char *const *params, idemp_rows_t **out, idem_error_t *err)
{
    int ok = name != NULL ? PQsendQueryPrepared(pg->conn, name, nparams, params, NULL, NULL, 0)
                          : PQsendQueryParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    if (!ok)
        return idemp_pg_send_failed(pg, sql, err);
    pg->queued++;
    if (out == NULL)
        return IDEM_OK;
    if (!PQsendFlushRequest(pg->conn) || PQflush(pg->conn) != 0)
        return idemp_pg_send_failed(pg, sql, err);
    while (pg->queued > 1)
        idemp_pg_read_queued(pg, "pipelined statement", NULL);
    PGresult *res = NULL;
    idemp_pg_read_queued(pg, sql, &res);
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
    pg->sent = false;
    pg->nread = 0;
    pg->keep_mask = 0;
    pg->nkept = 0;
    pg->commit_at = -1;
    memset(pg->qsql, 0, sizeof pg->qsql);
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
            idemp_pg_read_queued(pg, "pipelined statement", NULL);
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
        return idemp_pg_lost_check(pg, pg->perr.code, &pg->perr);
    }
    return IDEM_OK;
}
