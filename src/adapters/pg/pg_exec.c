/* pg_exec.c - statements on a connection: run one (in pipeline mode queued, see pg_pipeline.c),
 * COMMIT and ROLLBACK (with a pipeline in flight or left early, pg_async.c), a pipeline's last
 * statement with its sync, LISTEN. Above pg.c (connections, results, prepared statements), the
 * pipeline files and pg_async.c, none of which calls into this file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include <idem/log.h>

#include "pg_int.h"

/* ---- statements -------------------------------------------------------------------------- */

int idemp_pg_exec(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  idemp_rows_t **out, idem_error_t *err)
{
    if (out != NULL)
        *out = NULL;
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    if (pg->sent) /* a statement queued behind the sync would run outside its transaction */
        return idem_error_set(err, IDEM_ERR_INVALID, "a pipeline is in flight on %s", pg->where);
    const char *name;
    int rc = idemp_pg_prepared_name(pg, sql, nparams, &name, err);
    if (rc != IDEM_OK)
        return rc;
    if (pg->pipeline)
        return idemp_pg_pipeline_exec(pg, sql, name, nparams, params, out, err);
    PGresult *res = name != NULL
                        ? PQexecPrepared(pg->conn, name, nparams, params, NULL, NULL, 0)
                        : PQexecParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    idem_error_t e = {0};
    rc = idemp_pg_check_result(pg, pg->conn, res, sql, out, &e);
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    return idemp_pg_lost_check(pg, rc, &e);
}

int idemp_pg_command(idemp_pg_t *pg, const char *sql, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    if (pg->sent)
        return idem_error_set(err, IDEM_ERR_INVALID, "a pipeline is in flight on %s", pg->where);
    if (pg->pipeline)
        return idemp_pg_pipeline_exec(pg, sql, NULL, 0, NULL, NULL, err);
    idem_error_t e = {0};
    int rc = idemp_pg_check_result(pg, pg->conn, PQexec(pg->conn, sql), sql, NULL, &e);
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    return idemp_pg_lost_check(pg, rc, &e);
}

bool idemp_pg_in_transaction(const idemp_pg_t *pg)
{
    if (!idemp_pg_connected(pg))
        return false;
    PGTransactionStatusType t = PQtransactionStatus(pg->conn);
    return t == PQTRANS_INTRANS || t == PQTRANS_INERROR || t == PQTRANS_ACTIVE;
}

bool idemp_pg_tx_ended(const idemp_pg_t *pg)
{
    return idemp_pg_connected(pg) && !pg->pipeline && !pg->sent &&
           PQtransactionStatus(pg->conn) == PQTRANS_IDLE;
}

int idemp_pg_commit(idemp_pg_t *pg, const char *before, idem_error_t *err)
{
    if (!idemp_pg_connected(pg))
        return idem_error_set(err, IDEM_ERR_PG_LOST, "not connected to PostgreSQL at %s",
                              pg->where);
    int rc;
    if (pg->pipeline) {
        rc = before != NULL ? idemp_pg_exec(pg, before, 0, NULL, NULL, err) : IDEM_OK;
        if (rc == IDEM_OK)
            rc = idemp_pg_pipeline_exec(pg, "COMMIT", NULL, 0, NULL, NULL, err);
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
        if (rc == IDEM_OK && before != NULL)
            rc = idemp_pg_exec(pg, before, 0, NULL, NULL, err);
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
    if (pg->sent && pg->conn != NULL)
        idemp_pg_pipeline_wait(pg, NULL, 0, NULL); /* its outcome does not matter now */
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

/* ---- a pipeline's last statement ------------------------------------------------------- */

int idemp_pg_pipeline_finish(idemp_pg_t *pg, const char *sql, int nparams,
                             const char *const *params, idemp_rows_t **out, idem_error_t *err)
{
    *out = NULL;
    if (!pg->pipeline)
        return idemp_pg_exec(pg, sql, nparams, params, out, err);
    const char *name;
    int rc = idemp_pg_prepared_name(pg, sql, nparams, &name, err);
    if (rc != IDEM_OK)
        return rc;
    int ok = name != NULL ? PQsendQueryPrepared(pg->conn, name, nparams, params, NULL, NULL, 0)
                          : PQsendQueryParams(pg->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    if (!ok)
        return idemp_pg_send_failed(pg, sql, err);
    pg->queued++;
    if (!PQpipelineSync(pg->conn)) {
        idemp_pg_send_failed(pg, sql, err);
        return idemp_pg_pipeline_end(pg, NULL);
    }
    while (pg->queued > 1)
        idemp_pg_read_queued(pg, "pipelined statement", NULL);
    PGresult *res = NULL;
    idemp_pg_read_queued(pg, sql, &res);
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
        return idemp_pg_lost_check(pg, pg->perr.code, &pg->perr);
    }
    *out = (idemp_rows_t *)res;
    return IDEM_OK;
}

/* ---- LISTEN ------------------------------------------------------------------------------- */

int idemp_pg_listen(idemp_pg_t *pg, const char *channel, idem_error_t *err)
{
    char sql[96];
    snprintf(sql, sizeof sql, "LISTEN %s", channel); /* channel is a constant identifier */
    return idemp_pg_command(pg, sql, err);
}
