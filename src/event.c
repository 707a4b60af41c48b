/* event.c - what a handler sees: accessors, failure reasons, statements in the transaction. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "event.h"
#include "mask.h"

void idemp_event_init(struct idem_event *ev, const char *id, const char *type, const char *consumer,
                      json_t *payload, idemp_pg_t *pg)
{
    memset(ev, 0, sizeof *ev);
    ev->id = id;
    ev->type = type;
    ev->consumer = consumer;
    ev->payload = payload;
    ev->pg = pg;
}

const char *idem_event_id(const idem_event_t *ev)
{
    return ev->id;
}

const char *idem_event_type(const idem_event_t *ev)
{
    return ev->type;
}

const char *idem_event_consumer(const idem_event_t *ev)
{
    return ev->consumer;
}

json_t *idem_event_payload(const idem_event_t *ev)
{
    return ev->payload;
}

PGconn *idem_event_conn(idem_event_t *ev)
{
    /* a caller with the bare connection runs its own statements: nothing may stay queued */
    idemp_pg_pipeline_pause(ev->pg);
    return idemp_pg_conn(ev->pg);
}

idem_outcome idem_event_fail(idem_event_t *ev, idem_outcome outcome, const char *fmt, ...)
{
    if (!ev->failed) {
        va_list ap;
        va_start(ap, fmt);
        char *raw = idemp_vformat(fmt, ap);
        va_end(ap);
        idemp_mask_line(raw ? raw : "out of memory", ev->detail, sizeof ev->detail);
        free(raw);
        ev->failed = true;
    }
    return outcome;
}

idem_outcome idem_event_exec(idem_event_t *ev, const char *sql, int nparams,
                             const char *const *params, PGresult **out)
{
    idem_error_t err = {0};
    int rc = idemp_pg_exec(ev->pg, sql, nparams, params, out, &err);
    if (rc == IDEM_OK)
        return IDEM_DONE;
    if (rc == IDEM_ERR_PG_LOST)
        ev->pg_lost = true;
    idem_outcome o = idemp_pg_is_transient(&err) ? IDEM_RETRY : IDEM_REJECT;
    if (err.sqlstate[0])
        return idem_event_fail(ev, o, "SQLSTATE %s: %s", err.sqlstate, err.text);
    return idem_event_fail(ev, o, "%s", err.text);
}
