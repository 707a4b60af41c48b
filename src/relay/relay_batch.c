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

/* The acked rows, found where the claim locked them (their ctids; nobody can move a row we hold
 * locked), without a primary-key probe each. The commit after it need not wait for the disk (the
 * claim's settings, relay_claim.c): the event became durable at the emitter's commit, and a "sent"
 * mark lost in a crash only makes the row go out again, which the consumers' ledger absorbs. */
#define SQL_MARK_SENT                                                                              \
    "UPDATE idem.event_outbox o SET status = 'sent', sent_at = now()"                              \
    " WHERE o.ctid = ANY($1::tid[]) AND o.status = 'pending'"
/* ... through their ctids, whatever the statistics say: planned while they said next to nothing
 * was pending (after a TRUNCATE, or an ANALYZE between bursts), a scan of an index of pending rows
 * filtering on the ctids looked cheaper, and read every pending row for each batch (66 ms for 200
 * rows with 4,000 pending). These settings are the last statement's of the transaction but one:
 * the COMMIT follows. */
#define SQL_MARK_SETTINGS                                                                          \
    "SELECT set_config('enable_indexscan', 'off', true),"                                          \
    " set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true)"

/* A failed publish spends one attempt; the row waits base * 2^attempts (capped) or parks. */
#define SQL_MARK_FAILED                                                                            \
    "UPDATE idem.event_outbox o"                                                                   \
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
static bool isolating(idem_relay_t *r)
{
    if (r->nsuspects > 0 && idemp_now_ms() > r->suspects_until) {
        r->nsuspects = 0;
        r->suspect_out = false;
    }
    return r->nsuspects > 0;
}

static bool is_suspect(idem_relay_t *r, const char *outbox_id)
{
    if (!isolating(r))
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

size_t idemp_relay_unconfirmed(const idem_relay_t *r)
{
    size_t n = 0;
    for (int k = 0; k < r->nslots; k++)
        n += r->slots[k].phase == SLOT_PUBLISHING ? r->slots[k].waiting : 0;
    return n;
}

/* Confirms may cover rows of several batches (a multiple ack). */
static void on_confirm(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                       const char *message_id, size_t idlen)
{
    idem_relay_t *r = ud;
    int64_t now = idemp_now_ms();
    for (int k = 0; k < r->nslots; k++) {
        slot_t *sl = &r->slots[k];
        if (sl->phase != SLOT_PUBLISHING || sl->waiting == 0)
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
            if (row->state != R_SENT_WAIT) {
                sl->waiting--;
                sl->t_heard = now;
            }
        }
    }
}

int idemp_relay_take_confirms(idem_relay_t *r, idem_error_t *err)
{
    return idemp_amqp_take_confirms(r->amqp, on_confirm, r, err);
}

static int publish_row(idem_relay_t *r, row_t *row, idem_error_t *err)
{
    idemp_event_msg_t m = {row->event_id, row->subscription_id, row->event_type,
                           row->payload,  strlen(row->payload), row->created_s,
                           row->seq,      row->headers};
    idem_error_t e = {0};
    idemp_amqp_cork(r->amqp); /* the loop flushes before it waits */
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
int idemp_relay_publish(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
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
        if (alone && idemp_relay_unconfirmed(r) > 0) {
            r->suspect_waiting = true; /* a suspect goes out alone: when the others are confirmed */
            continue;
        }
        int rc = publish_row(r, row, err);
        if (rc != IDEM_OK)
            return rc;
        if (row->state != R_SENT_WAIT)
            continue; /* poison: settled as a failed attempt, later rows are held */
        if (sl->waiting++ == 0)
            sl->t_heard = idemp_now_ms();
        r->suspect_out = alone;
    }
    return IDEM_OK;
}

/* ---- marking and committing ------------------------------------------------------------------ */

bool idemp_relay_settled(const slot_t *sl)
{
    for (size_t i = 0; i < sl->n; i++)
        if (sl->rows[i].state == R_SENT_WAIT || sl->rows[i].state == R_UNSENT)
            return false;
    return true;
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

static bool failed_row(const row_t *row)
{
    return row->state == R_NACKED || row->state == R_RETURNED || row->state == R_POISON;
}

/* The marks of the batch and its COMMIT, in one pipeline on its open transaction: one statement
 * marks the acked rows sent, one spends an attempt on each failed row. */
int idemp_relay_settle(idem_relay_t *r, slot_t *sl, bool seam, idem_error_t *err)
{
    idemp_pgarray_t ids, fids, why;
    idemp_pgarray_init(&ids);
    idemp_pgarray_init(&fids);
    idemp_pgarray_init(&why);
    size_t nsent = 0, nfail = 0;
    for (size_t i = 0; i < sl->n; i++) {
        row_t *row = &sl->rows[i];
        if (row->state == R_ACKED) {
            idemp_pgarray_add(&ids, row->tid);
            nsent++;
        } else if (failed_row(row)) {
            char buf[300];
            idemp_pgarray_add(&fids, row->outbox_id);
            idemp_pgarray_add(&why, failure_reason(r, row, buf, sizeof buf));
            nfail++;
        }
    }
    if (seam && nsent > 0)
        idemp_fault_point("relay.after_publish");
    char att[16], base[32], max[32];
    snprintf(att, sizeof att, "%d", r->cfg.max_attempts);
    snprintf(base, sizeof base, "%lld", (long long)r->cfg.backoff_base_ms);
    snprintf(max, sizeof max, "%lld", (long long)r->cfg.backoff_max_ms);
    int rc = idemp_pg_pipeline_begin(sl->pg, err);
    /* the failed rows first: they are found by their ids, and the sent rows' settings would
     * leave that statement nothing but a TID scan */
    if (rc == IDEM_OK && nfail > 0) {
        const char *p[] = {idemp_pgarray_str(&fids), att, base, max, idemp_pgarray_str(&why)};
        rc = p[0] && p[4] ? idemp_pg_queue(sl->pg, SQL_MARK_FAILED, 5, p, true, err)
                          : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    if (rc == IDEM_OK && nsent > 0)
        rc = idemp_pg_queue(sl->pg, SQL_MARK_SETTINGS, 0, NULL, false, err);
    if (rc == IDEM_OK && nsent > 0) {
        const char *p[] = {idemp_pgarray_str(&ids)};
        rc = p[0] ? idemp_pg_queue(sl->pg, SQL_MARK_SENT, 1, p, true, err)
                  : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    if (rc == IDEM_OK)
        rc = idemp_pg_queue_commit(sl->pg, err);
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_send(sl->pg, err);
    idemp_pgarray_free(&ids);
    idemp_pgarray_free(&fids);
    idemp_pgarray_free(&why);
    sl->phase = SLOT_SETTLING;
    sl->t_settle = idemp_now_ms();
    idemp_relay_sent(sl);
    return rc;
}

/* Logs and counts what the failed-rows statement returned. */
static void note_failed(idem_relay_t *r, slot_t *sl, idemp_rows_t *res)
{
    size_t nfail = 0;
    for (size_t i = 0; i < sl->n; i++)
        nfail += failed_row(&sl->rows[i]);
    for (int i = 0; i < idemp_rows_count(res); i++) {
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
    r->stats.failures += nfail;
    idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISH_FAILURES, nfail);
}

void idemp_relay_slot_done(slot_t *sl)
{
    idemp_rows_free(sl->heads); /* rows[] borrowed strings from these: done with them now */
    idemp_rows_free(sl->res);
    sl->heads = NULL;
    sl->res = NULL;
    sl->phase = SLOT_FREE;
    sl->n = 0;
    sl->waiting = 0;
}

void idemp_relay_settled_ok(idem_relay_t *r, slot_t *sl, idemp_rows_t **rows)
{
    size_t nsent = 0, nfail = 0;
    for (size_t i = 0; i < sl->n; i++) {
        nsent += sl->rows[i].state == R_ACKED;
        nfail += failed_row(&sl->rows[i]);
        if (sl->rows[i].state == R_NACKED)
            r->reopen_amqp = true;
    }
    int k = 0; /* the kept results, in queue order: the failed rows', the sent rows' */
    if (nfail > 0)
        note_failed(r, sl, rows[k++]);
    uint64_t sent = nsent > 0 ? (uint64_t)idemp_rows_affected(rows[k]) : 0;
    size_t n = sl->n;
    if (n > 0) {
        r->stats.published += sent;
        r->stats.batches++;
        idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISHED, sent);
        idemp_metrics_batch_duration(r->metrics, (double)(idemp_now_ms() - sl->t0) / 1000.0);
        char a[24], b[24], c1[24], d[24], e[24], f[24];
        snprintf(a, sizeof a, "%zu", n);
        snprintf(b, sizeof b, "%llu", (unsigned long long)sent);
        snprintf(c1, sizeof c1, "%lld", (long long)(sl->t_claim - sl->t0));
        snprintf(d, sizeof d, "%lld", (long long)(sl->t_pub - sl->t_claim));
        snprintf(e, sizeof e, "%lld", (long long)(sl->t_settle - sl->t_pub));
        snprintf(f, sizeof f, "%lld", (long long)(idemp_now_ms() - sl->t_settle));
        const char *kv[] = {
            "claimed",         a, "sent",           b, "claim_ms", c1, "publish_ms", d,
            "confirm_wait_ms", e, "mark_commit_ms", f, NULL};
        idem_log(IDEM_LOG_DEBUG, LOGC, kv, "batch committed");
    }
    idemp_relay_slot_done(sl);
}

void idemp_relay_abort_slot(idem_relay_t *r, slot_t *sl)
{
    (void)r;
    idemp_pg_rollback(sl->pg); /* also a claim that failed before anything was published */
    idemp_relay_slot_done(sl);
}

/* Does the broker's close name a fault of one message rather than of the link or the setup? */
static bool message_fault(int close_code)
{
    return close_code == 406 /* PRECONDITION_FAILED: e.g. a message over the size limit */ ||
           close_code == 501 /* FRAME_ERROR */ || close_code == 502 /* SYNTAX_ERROR */ ||
           close_code == 505 /* UNEXPECTED_FRAME */;
}

/* Waits for the settle pipeline of sl and finishes the batch; a failure rolls it back. */
static void settle_now(idem_relay_t *r, slot_t *sl)
{
    idemp_rows_t *rows[2] = {NULL, NULL};
    idem_error_t e = {0};
    int rc = sl->phase == SLOT_SETTLING ? IDEM_OK : idemp_relay_settle(r, sl, false, &e);
    if (rc == IDEM_OK)
        rc = idemp_pg_pipeline_wait(sl->pg, rows, 2, &e);
    if (rc == IDEM_OK) {
        idemp_relay_settled_ok(r, sl, rows);
    } else {
        const char *kv[] = {"server", "postgres", NULL};
        idem_log(IDEM_LOG_WARN, LOGC, kv, "batch rolled back, nothing spent: %s", e.text);
        idemp_relay_abort_slot(r, sl);
    }
    idemp_rows_free(rows[0]);
    idemp_rows_free(rows[1]);
}

void idemp_relay_salvage(idem_relay_t *r, int rc, const idem_error_t *err)
{
    int code = rc == IDEM_ERR_AMQP ? idemp_amqp_close_code(r->amqp) : 0;
    bool by_message = message_fault(code);
    size_t open = idemp_relay_unconfirmed(r);
    for (int k = 0; k < r->nslots; k++) {
        slot_t *sl = &r->slots[k];
        for (size_t i = 0; sl->phase == SLOT_PUBLISHING && i < sl->n; i++) {
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
        sl->waiting = 0;
    }
    r->suspect_out = false;
    if (by_message && open > 1) {
        const char *kv[] = {"server", idemp_amqp_where(r->amqp), NULL};
        idem_log(IDEM_LOG_WARN, LOGC, kv,
                 "the broker refused one of %zu unconfirmed messages; each goes out alone until "
                 "it is found",
                 open);
    }
    /* what the broker confirmed is marked, oldest batch first; the rest stays pending, nothing
     * spent; a claim in flight is rolled back */
    for (;;) {
        slot_t *oldest = NULL;
        for (int k = 0; k < r->nslots; k++)
            if (r->slots[k].phase != SLOT_FREE &&
                (oldest == NULL || r->slots[k].order < oldest->order))
                oldest = &r->slots[k];
        if (oldest == NULL)
            break;
        if (oldest->phase == SLOT_LOCKING || oldest->phase == SLOT_READING)
            idemp_relay_abort_slot(r, oldest);
        else
            settle_now(r, oldest);
    }
}
