/* event.c - what a handler sees: accessors, failure reasons, statements in the transaction. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "event.h"
#include "mask.h"
#include "policy.h"

void idemp_event_init(struct idem_event *ev, const char *id, const char *type, const char *consumer,
                      const char *subscription, json_t *payload, const idemp_msg_t *msg,
                      idemp_pg_t *pg)
{
    memset(ev, 0, sizeof *ev);
    ev->id = id;
    ev->type = type;
    ev->consumer = consumer;
    ev->subscription = subscription ? subscription : "";
    ev->payload = payload;
    ev->msg = msg;
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

const char *idem_event_subscription(const idem_event_t *ev)
{
    return ev->subscription[0] ? ev->subscription : NULL;
}

bool idem_event_seq(const idem_event_t *ev, int64_t *seq)
{
    if (ev->has_seq && seq != NULL)
        *seq = ev->seq;
    return ev->has_seq;
}

const char *idem_event_header(idem_event_t *ev, const char *name)
{
    size_t len = 0;
    const char *v = ev->msg != NULL && name != NULL ? idemp_msg_header(ev->msg, name, &len) : NULL;
    if (v == NULL || len >= sizeof ev->header_buf || memchr(v, '\0', len) != NULL)
        return NULL;
    memcpy(ev->header_buf, v, len);
    ev->header_buf[len] = '\0';
    return ev->header_buf;
}

json_t *idem_event_payload(const idem_event_t *ev)
{
    return ev->payload;
}

PGconn *idem_event_conn(idem_event_t *ev)
{
    /* a caller with the bare connection runs its own statements: nothing may stay queued */
    ev->took_conn = true;
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

/* The next word of sql at *p (letters, upper-cased into w), skipping blanks; "" at the end. */
static void next_word(const char **p, char *w, size_t sz)
{
    const char *s = *p;
    while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == '(')
        s++;
    size_t n = 0;
    for (; isalpha((unsigned char)*s); s++)
        if (n + 1 < sz)
            w[n++] = (char)toupper((unsigned char)*s);
    w[n] = '\0';
    *p = s;
}

bool idemp_sql_ends_transaction(const char *sql)
{
    char w1[16], w2[16];
    const char *p = sql != NULL ? sql : "";
    next_word(&p, w1, sizeof w1);
    next_word(&p, w2, sizeof w2);
    if (strcmp(w1, "ROLLBACK") == 0)
        return strcmp(w2, "TO") != 0;
    if (strcmp(w1, "START") == 0 || strcmp(w1, "PREPARE") == 0)
        return strcmp(w2, "TRANSACTION") == 0;
    static const char *const words[] = {"COMMIT", "END", "ABORT", "BEGIN"};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
        if (strcmp(w1, words[i]) == 0)
            return true;
    return false;
}

idem_outcome idem_event_exec(idem_event_t *ev, const char *sql, int nparams,
                             const char *const *params, PGresult **out)
{
    idem_error_t err = {0};
    if (out != NULL)
        *out = NULL;
    if (idemp_sql_ends_transaction(sql)) {
        snprintf(ev->sqlstate, sizeof ev->sqlstate, "2D000");
        return idem_event_fail(ev, IDEM_REJECT,
                               "SQLSTATE 2D000: refused %.40s: a handler that ended the claim's "
                               "transaction, or began another, would commit effects without claims",
                               sql);
    }
    int rc = idemp_pg_exec(ev->pg, sql, nparams, params, (idemp_rows_t **)out, &err);
    if (rc == IDEM_OK) {
        /* a statement that runs means the transaction recovered (ROLLBACK TO SAVEPOINT) from
         * any earlier failure: that one no longer decides */
        ev->sqlstate[0] = '\0';
        return IDEM_DONE;
    }
    if (rc == IDEM_ERR_PG_LOST)
        ev->pg_lost = true;
    snprintf(ev->sqlstate, sizeof ev->sqlstate, "%s", err.sqlstate);
    idem_outcome o =
        idemp_policy_for_handler(err.sqlstate) == IDEMP_POLICY_REJECT ? IDEM_REJECT : IDEM_RETRY;
    if (err.sqlstate[0])
        return idem_event_fail(ev, o, "SQLSTATE %s: %s", err.sqlstate, err.text);
    return idem_event_fail(ev, o, "%s", err.text);
}
