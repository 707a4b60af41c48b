/* relay_batch.c - one batch of the relay after its claim (relay_claim.c): publish in waves with
 * confirms, mark the outcome in the claiming transaction, commit; and what happens to a batch
 * when the broker link fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "fault.h"
#include "relay_int.h"

/* Transaction-local settings (nothing leaks to other clients of a pooled server connection):
 * the relay's commits need not wait for the disk, because the event became durable at the
 * emitter's commit and a "sent" mark lost in a crash only makes the row go out again, which the
 * consumers' ledger absorbs (the crash between confirm and mark); the claim's plans do not depend
 * on its parameters, and planning it with a 200-element array costs more than running it. */
#define SQL_MARK_SENT                                                                              \
    "UPDATE event_outbox o SET status = 'sent', sent_at = now()"                                   \
    "  FROM unnest($1::uuid[]) AS c(id)"                                                           \
    " WHERE o.outbox_id = c.id AND o.status = 'pending'"

/* A failed publish spends one attempt; the row waits base * 2^attempts (capped) or parks. */
#define SQL_MARK_FAILED                                                                            \
    "UPDATE event_outbox o"                                                                        \
    "   SET attempts = o.attempts + 1, last_error = f.err,"                                        \
    "       status = CASE WHEN o.attempts + 1 >= $2::int THEN 'failed' ELSE 'pending' END,"        \
    "       next_attempt_at = now() + LEAST($4::float8, $3::float8 * power(2::float8,"             \
    "                         LEAST(o.attempts, 60))) * interval '1 millisecond'"                  \
    "  FROM unnest($1::uuid[], $5::text[]) AS f(id, err)"                                          \
    " WHERE o.outbox_id = f.id AND o.status = 'pending'"                                           \
    " RETURNING o.outbox_id, o.event_id, o.status, o.attempts"

static const char *const LOGC = "relay";

/* ---- suspects -------------------------------------------------------------------------------- */

/* Rows that were unconfirmed when the broker closed the channel because of a message, and rows
 * found to be such a message: each goes out alone, nothing else while it waits for its confirm,
 * so that the next refusal names one row. They are forgotten once confirmed, or after a while. */
bool idemp_relay_isolating(idem_relay_t *r)
{
    if (r->nsuspects > 0 && idemp_now_ms() > r->suspects_until) {
        r->nsuspects = 0;
        r->suspect_out = false;
    }
    return r->nsuspects > 0;
}

static bool is_suspect(idem_relay_t *r, const char *outbox_id)
{
    if (!idemp_relay_isolating(r))
        return false;
    for (size_t i = 0; i < r->nsuspects; i++)
        if (strcmp(r->suspects[i], outbox_id) == 0)
            return true;
    return false;
}

static void add_suspect(idem_relay_t *r, const char *outbox_id)
{
    r->suspects_until = idemp_now_ms() + SUSPECTS_KEEP_MS;
    if (is_suspect(r, outbox_id) || r->nsuspects == SUSPECTS_MAX)
        return;
    snprintf(r->suspects[r->nsuspects++], sizeof r->suspects[0], "%s", outbox_id);
}

static void forget_suspect(idem_relay_t *r, const char *outbox_id)
{
    for (size_t i = 0; i < r->nsuspects; i++)
        if (strcmp(r->suspects[i], outbox_id) == 0) {
            memmove(r->suspects[i], r->suspects[i + 1],
                    (r->nsuspects - i - 1) * sizeof r->suspects[0]);
            r->nsuspects--;
            return;
        }
}

/* ---- publishing ----------------------------------------------------------------------------- */

static size_t unconfirmed(const idem_relay_t *r)
{
    size_t n = 0;
    for (int k = 0; k < NSLOTS; k++)
        for (size_t i = 0; r->slots[k].inflight && i < r->slots[k].n; i++)
            n += r->slots[k].rows[i].state == R_SENT_WAIT;
    return n;
}

/* Confirms may cover rows of both in-flight batches (a multiple ack). */
static void on_confirm(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                       const char *message_id, size_t idlen)
{
    idem_relay_t *r = ud;
    for (int k = 0; k < NSLOTS; k++) {
        slot_t *sl = &r->slots[k];
        if (!sl->inflight)
            continue;
        for (size_t i = 0; i < sl->n; i++) {
            row_t *row = &sl->rows[i];
            if (row->state != R_SENT_WAIT)
                continue;
            if (kind == IDEMP_CONFIRM_RETURN) {
                if (message_id != NULL && idlen == 36 && memcmp(row->event_id, message_id, 36) == 0)
                    row->state = R_RETURNED;
            } else if (multiple ? row->tag <= tag : row->tag == tag) {
                row->state = kind == IDEMP_CONFIRM_ACK ? R_ACKED : R_NACKED;
                if (r->nsuspects > 0) {
                    forget_suspect(r, row->outbox_id); /* the broker took it: not the one */
                    r->suspect_out = false;
                }
            }
        }
    }
}

static int publish_row(idem_relay_t *r, row_t *row, idem_error_t *err)
{
    idemp_event_msg_t m = {row->event_id, row->subscription_id, row->event_type,
                           row->payload,  strlen(row->payload), row->created_s,
                           row->seq,      row->headers};
    idem_error_t e = {0};
    int rc = idemp_amqp_publish_event(r->amqp, r->exchange, &m, &row->tag, &e);
    if (rc == IDEM_ERR_UNENCODABLE) {
        snprintf(row->why, sizeof row->why, "cannot be published: %.170s", e.text);
        row->state = R_POISON;
        return IDEM_OK;
    }
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    if (rc == IDEM_OK)
        row->state = R_SENT_WAIT;
    return rc;
}

/* Publishes every row whose subscription has no earlier row in the batch still unconfirmed; a row
 * behind a failed (or held) row is held. Rows of distinct subscriptions all go in the first wave;
 * a subscription's next row goes only once the broker has confirmed its previous one, so a
 * returned or nacked event is never overtaken by a later event of its subscription. While
 * isolating suspects, one row at a time goes out, and only when nothing else is unconfirmed. */
static int publish_wave(idem_relay_t *r, slot_t *sl, size_t *published, idem_error_t *err)
{
    *published = 0;
    for (size_t i = 0; i < sl->n && !r->suspect_out; i++) {
        row_t *row = &sl->rows[i];
        if (row->state != R_UNSENT)
            continue;
        enum rstate before = row->prev < 0 ? R_ACKED : sl->rows[row->prev].state;
        if (before == R_UNSENT || before == R_SENT_WAIT)
            continue; /* next wave */
        if (before != R_ACKED) {
            row->state = R_HELD;
            continue;
        }
        bool alone = is_suspect(r, row->outbox_id);
        if (alone && unconfirmed(r) > 0)
            continue; /* a suspect goes out alone: when the others are confirmed */
        int rc = publish_row(r, row, err);
        if (rc != IDEM_OK)
            return rc;
        if (row->state != R_SENT_WAIT)
            continue; /* poison: settled as a failed attempt, later rows are held */
        sl->last_tag = row->tag;
        (*published)++;
        r->suspect_out = alone;
    }
    return IDEM_OK;
}

int idemp_relay_publish_first(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    size_t published;
    return publish_wave(r, sl, &published, err);
}

/* ---- confirms and marking -------------------------------------------------------------------- */

/* True when no row of sl waits for a confirm or a wave. */
static bool settled(const slot_t *sl)
{
    for (size_t i = 0; i < sl->n; i++)
        if (sl->rows[i].state == R_SENT_WAIT || sl->rows[i].state == R_UNSENT)
            return false;
    return true;
}

int idemp_relay_confirm(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    int rc = IDEM_OK;
    int64_t deadline = idemp_now_ms() + r->cfg.confirm_timeout_ms;
    while (rc == IDEM_OK && !settled(sl)) {
        int64_t w0 = idemp_now_ms();
        if (w0 >= deadline)
            return idem_error_set(err, IDEM_ERR_TIMEOUT,
                                  "no publisher confirm from RabbitMQ at %s within %lld ms",
                                  idemp_amqp_where(r->amqp), (long long)r->cfg.confirm_timeout_ms);
        /* short slices: the backlog gauge stays fresh while the broker is slow */
        int64_t slice = deadline - w0 < 250 ? deadline - w0 : 250;
        uint64_t last = 0;
        for (int k = 0; k < NSLOTS; k++)
            for (size_t i = 0; r->slots[k].inflight && i < r->slots[k].n; i++)
                if (r->slots[k].rows[i].state == R_SENT_WAIT && r->slots[k].rows[i].tag > last)
                    last = r->slots[k].rows[i].tag;
        if (last > 0)
            rc = idemp_amqp_wait_confirms(r->amqp, last, slice, on_confirm, r, err);
        sl->wait_ms += idemp_now_ms() - w0;
        if (rc == IDEM_ERR_TIMEOUT) {
            rc = IDEM_OK;
            idemp_relay_update_gauge(r, false);
            continue;
        }
        if (rc == IDEM_OK) {
            size_t published;
            rc = publish_wave(r, sl, &published, err);
            idemp_relay_update_gauge(r, false);
        }
    }
    if (rc == IDEM_OK) {
        sl->confirmed = true;
        sl->t_conf = idemp_now_ms();
    }
    return rc;
}

static const char *failure_reason(const idem_relay_t *r, const row_t *row, char *buf, size_t sz)
{
    switch (row->state) {
    case R_RETURNED:
        snprintf(buf, sz,
                 "unroutable: the broker returned it (no queue bound to exchange '%s' for routing "
                 "key '%.100s')",
                 r->exchange, row->event_type);
        return buf;
    case R_NACKED:
        return "the broker nacked the publish";
    default:
        return row->why;
    }
}

/* Spends an attempt on each failed row of sl in its open transaction. */
static int mark_failed(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    idemp_pgarray_t ids, why;
    idemp_pgarray_init(&ids);
    idemp_pgarray_init(&why);
    size_t nfail = 0;
    for (size_t i = 0; i < sl->n; i++) {
        row_t *row = &sl->rows[i];
        if (row->state != R_NACKED && row->state != R_RETURNED && row->state != R_POISON)
            continue;
        char buf[300];
        idemp_pgarray_add(&ids, row->outbox_id);
        idemp_pgarray_add(&why, failure_reason(r, row, buf, sizeof buf));
        nfail++;
    }
    int rc = IDEM_OK;
    if (nfail > 0) {
        char att[16], base[32], max[32];
        snprintf(att, sizeof att, "%d", r->cfg.max_attempts);
        snprintf(base, sizeof base, "%lld", (long long)r->cfg.backoff_base_ms);
        snprintf(max, sizeof max, "%lld", (long long)r->cfg.backoff_max_ms);
        const char *p[] = {idemp_pgarray_str(&ids), att, base, max, idemp_pgarray_str(&why)};
        idemp_rows_t *res = NULL;
        rc = p[0] && p[4] ? idemp_pg_exec(sl->pg, SQL_MARK_FAILED, 5, p, &res, err)
                          : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        for (int i = 0; rc == IDEM_OK && i < idemp_rows_count(res); i++) {
            bool parked = strcmp(idemp_rows_get(res, i, 2), "failed") == 0;
            const char *oid = idemp_rows_get(res, i, 0);
            const char *why_s = "";
            char buf[300];
            for (size_t j = 0; j < sl->n; j++)
                if (strcmp(sl->rows[j].outbox_id, oid) == 0)
                    why_s = failure_reason(r, &sl->rows[j], buf, sizeof buf);
            const char *kv[] = {"outbox_id", oid,
                                "event_id",  idemp_rows_get(res, i, 1),
                                "attempts",  idemp_rows_get(res, i, 3),
                                NULL};
            if (parked) {
                r->stats.parked++;
                idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PARKED, 1);
                idem_log(IDEM_LOG_ERROR, LOGC, kv, "event parked as failed after max attempts: %s",
                         why_s);
            } else {
                idem_log(IDEM_LOG_WARN, LOGC, kv, "publish failed, will retry: %s", why_s);
            }
        }
        idemp_rows_free(res);
        r->stats.failures += nfail;
        idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISH_FAILURES, nfail);
    }
    idemp_pgarray_free(&ids);
    idemp_pgarray_free(&why);
    return rc;
}

/* Marks the batch's outcome in the open transaction and commits. */
static int mark_and_commit(idem_relay_t *r, slot_t *sl, uint64_t *sent, idem_error_t *err)
{
    idemp_pgarray_t ids;
    idemp_pgarray_init(&ids);
    size_t nsent = 0;
    for (size_t i = 0; i < sl->n; i++)
        if (sl->rows[i].state == R_ACKED) {
            idemp_pgarray_add(&ids, sl->rows[i].outbox_id);
            nsent++;
        }
    int rc = IDEM_OK;
    *sent = 0;
    if (nsent > 0) {
        const char *p[] = {idemp_pgarray_str(&ids)};
        idemp_rows_t *res = NULL;
        rc = p[0] ? idemp_pg_exec(sl->pg, SQL_MARK_SENT, 1, p, &res, err)
                  : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        if (rc == IDEM_OK)
            *sent = (uint64_t)idemp_rows_affected(res);
        idemp_rows_free(res);
    }
    idemp_pgarray_free(&ids);
    if (rc == IDEM_OK)
        rc = mark_failed(r, sl, err);
    if (rc == IDEM_OK)
        rc = idemp_pg_commit(sl->pg, err);
    return rc;
}

static void slot_done(slot_t *sl)
{
    idemp_rows_free(sl->res); /* rows[] borrowed strings from res: done with them now */
    sl->res = NULL;
    sl->inflight = false;
    sl->n = 0;
}

int idemp_relay_commit(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    int rc = idemp_relay_confirm(r, sl, err);
    int64_t t_conf = sl->t_conf;
    uint64_t sent = 0;
    if (rc == IDEM_OK) {
        size_t acked = 0;
        for (size_t i = 0; i < sl->n; i++)
            acked += sl->rows[i].state == R_ACKED;
        if (acked > 0)
            idemp_fault_point("relay.after_publish");
        rc = mark_and_commit(r, sl, &sent, err);
    }
    if (rc != IDEM_OK)
        return rc; /* the caller salvages or aborts every open batch */
    for (size_t i = 0; i < sl->n; i++)
        if (sl->rows[i].state == R_NACKED)
            r->reopen_amqp = true;
    size_t n = sl->n;
    slot_done(sl);
    r->stats.published += sent;
    r->stats.batches++;
    idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISHED, sent);
    idemp_metrics_batch_duration(r->metrics, (double)(idemp_now_ms() - sl->t0) / 1000.0);
    if (n > 0) {
        char a[24], b[24], c1[24], d[24], e[24], f[24];
        snprintf(a, sizeof a, "%zu", n);
        snprintf(b, sizeof b, "%llu", (unsigned long long)sent);
        snprintf(c1, sizeof c1, "%lld", (long long)(sl->t_claim - sl->t0));
        snprintf(d, sizeof d, "%lld", (long long)(sl->t_pub - sl->t_claim));
        snprintf(e, sizeof e, "%lld", (long long)sl->wait_ms);
        snprintf(f, sizeof f, "%lld", (long long)(idemp_now_ms() - t_conf));
        const char *kv[] = {
            "claimed",         a, "sent",           b, "claim_ms", c1, "publish_ms", d,
            "confirm_wait_ms", e, "mark_commit_ms", f, NULL};
        idem_log(IDEM_LOG_DEBUG, LOGC, kv, "batch committed");
    }
    return IDEM_OK;
}

void idemp_relay_abort_slot(idem_relay_t *r, slot_t *sl)
{
    idemp_pg_rollback(sl->pg); /* also a claim that failed before its slot was in flight */
    slot_done(sl);
}

void idemp_relay_abort_all(idem_relay_t *r)
{
    for (int k = 0; k < NSLOTS; k++)
        idemp_relay_abort_slot(r, &r->slots[k]);
}

/* Does the broker's close name a fault of one message rather than of the link or the setup? */
static bool message_fault(int close_code)
{
    return close_code == 406 /* PRECONDITION_FAILED: e.g. a message over the size limit */ ||
           close_code == 501 /* FRAME_ERROR */ || close_code == 502 /* SYNTAX_ERROR */ ||
           close_code == 505 /* UNEXPECTED_FRAME */;
}

void idemp_relay_salvage(idem_relay_t *r, int rc, const idem_error_t *err)
{
    int code = rc == IDEM_ERR_AMQP ? idemp_amqp_close_code(r->amqp) : 0;
    bool by_message = message_fault(code);
    size_t open = unconfirmed(r);
    for (int k = 0; k < NSLOTS; k++) {
        slot_t *sl = &r->slots[k];
        for (size_t i = 0; sl->inflight && i < sl->n; i++) {
            row_t *row = &sl->rows[i];
            if (row->state == R_UNSENT) {
                row->state = R_HELD;
            } else if (row->state == R_SENT_WAIT && by_message && open == 1) {
                /* it alone was out when the broker refused: it is the one; it spends an
                 * attempt, and goes out alone next time too */
                snprintf(row->why, sizeof row->why, "refused by the broker: %.170s", err->text);
                row->state = R_POISON;
                add_suspect(r, row->outbox_id);
            } else if (row->state == R_SENT_WAIT) {
                row->state = R_UNKNOWN;
                if (by_message)
                    add_suspect(r, row->outbox_id);
            }
        }
    }
    r->suspect_out = false;
    if (by_message && open > 1) {
        const char *kv[] = {"server", idemp_amqp_where(r->amqp), NULL};
        idem_log(IDEM_LOG_WARN, LOGC, kv,
                 "the broker refused one of %zu unconfirmed messages; each goes out alone until "
                 "it is found",
                 open);
    }
    /* what the broker confirmed is marked; the rest stays pending, nothing spent */
    for (;;) {
        slot_t *oldest = NULL;
        for (int k = 0; k < NSLOTS; k++)
            if (r->slots[k].inflight && (oldest == NULL || r->slots[k].order < oldest->order))
                oldest = &r->slots[k];
        if (oldest == NULL)
            break;
        uint64_t sent = 0;
        idem_error_t e = {0};
        if (mark_and_commit(r, oldest, &sent, &e) != IDEM_OK) {
            idemp_relay_abort_all(r);
            return;
        }
        r->stats.published += sent;
        idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISHED, sent);
        slot_done(oldest);
    }
    idemp_relay_abort_all(r); /* a claim that failed before its slot was in flight */
}
