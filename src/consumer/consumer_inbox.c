/* consumer_inbox.c - the deliveries in hand: read from the broker into the window (validated on
 * arrival), dead-letter copies published, acks sent for what is done. A delivery leaves the
 * window only acked, or together with its channel (the broker then gives it back). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "consumer_int.h"
#include "fault.h"
#include "mask.h"

#define CONFIRM_TIMEOUT_MS 30000
#define WINDOW_BYTES_MIN (16LL << 20)

static void delivery_free(delivery_t *d)
{
    if (d == NULL)
        return;
    json_decref(d->ev.payload);
    idemp_msg_free(d->msg);
    free(d);
}

/* Forgets every delivery in hand; only together with their channel (the broker requeues them). */
void idemp_consumer_drop_window(idem_consumer_t *c)
{
    idemp_consumer_forget_inflight(c); /* it points into the window */
    for (size_t i = 0; i < c->nwin; i++)
        delivery_free(c->win[i]);
    c->nwin = 0;
    c->win_bytes = 0;
}

/* Deliveries of a dead channel come again from the broker: forget them with it. */
void idemp_consumer_channel_lost(idem_consumer_t *c, const char *why)
{
    idemp_amqp_disconnect(c->in, why);
    idemp_amqp_disconnect(c->out, why);
    idemp_consumer_drop_window(c);
}

static void validate(idem_consumer_t *c, delivery_t *d)
{
    d->part = -1;
    for (int i = 0; i < c->nqueues; i++)
        if (idemp_msg_from_queue(d->msg, c->queues[i])) {
            d->qidx = i;
            d->part = c->queue_part[i];
            break;
        }
    idemp_envelope_in_t in;
    idemp_msg_envelope_in(d->msg, &in);
    d->dl_code = idemp_envelope_parse(&in, c->cfg.max_message_bytes, idemp_wall_ms(), &d->ev,
                                      d->detail, sizeof d->detail);
    if (d->dl_code == IDEMP_DL_NONE) {
        d->handler = idemp_registry_find(c->reg, d->ev.event_type);
        if (d->handler == NULL) {
            d->dl_code = IDEMP_DL_UNKNOWN_TYPE;
            char shown[201]; /* whole characters only: x-idem-error stays UTF-8 */
            idemp_log_escape(d->ev.event_type, shown, sizeof shown, false);
            snprintf(d->detail, sizeof d->detail, "no handler for event type '%s'", shown);
        }
    }
    /* who published it decides first: an untrusted message is never claimed, whatever it holds */
    char why[sizeof d->detail];
    if (!idemp_envelope_trusted(in.user_id, c->cfg.trusted_publishers, why, sizeof why)) {
        json_decref(d->ev.payload);
        d->ev.payload = NULL;
        d->dl_code = IDEMP_DL_UNTRUSTED;
        snprintf(d->detail, sizeof d->detail, "%s", why);
    }
    if (d->dl_code == IDEMP_DL_NONE &&
        !idemp_digest_event(d->ev.event_type, d->ev.subscription_id, d->ev.payload, d->digest))
        d->digest[0] = '\0'; /* out of memory: claimed without one, compared with nothing */
    d->state = d->dl_code == IDEMP_DL_NONE ? D_READY : D_DEAD;
}

/* Publishes d's dead-letter copy; on success d is DONE. */
static int dead_letter(idem_consumer_t *c, delivery_t *d)
{
    char reason[700];
    snprintf(reason, sizeof reason, "%s: %s", idemp_dl_code_name(d->dl_code), d->detail);
    idem_error_t err = {0};
    int rc = idemp_amqp_dead_letter(c->out, c->in, d->msg, c->dlx, c->dlq, reason,
                                    CONFIRM_TIMEOUT_MS, &err);
    if (rc != IDEM_OK) {
        idemp_consumer_log(IDEM_LOG_ERROR, c, d, "dead-lettering failed, will retry: %s", err.text);
        idemp_amqp_disconnect(c->out, err.text);
        return rc;
    }
    idemp_metrics_dead_letter(c->metrics, d->dl_code);
    idemp_metrics_event(c->metrics, d->ev.event_type, IDEMP_OUT_DEAD_LETTERED);
    idemp_consumer_log(IDEM_LOG_WARN, c, d, "dead-lettered to %s: %s", c->dlq, reason);
    d->state = D_DONE;
    return IDEM_OK;
}

void idemp_consumer_dead_letter_all(idem_consumer_t *c)
{
    for (size_t i = 0; i < c->nwin && idemp_amqp_connected(c->out); i++)
        if (c->win[i]->state == D_DEAD)
            dead_letter(c, c->win[i]);
}

/* Acks what is DONE and takes it out of the window. */
void idemp_consumer_ack_done(idem_consumer_t *c)
{
    if (c->nwin == 0)
        return;
    size_t *single = malloc(c->nwin * sizeof *single);
    if (single == NULL) {
        idemp_consumer_channel_lost(c, "out of memory acking");
        return;
    }
    uint64_t multi;
    size_t ns = idemp_window_ack_plan(c->win, c->nwin, &multi, single);
    idem_error_t err = {0};
    int rc = multi ? idemp_amqp_ack(c->in, multi, true, &err) : IDEM_OK;
    for (size_t i = 0; rc == IDEM_OK && i < ns; i++)
        rc = idemp_amqp_ack(c->in, c->win[single[i]]->tag, false, &err);
    free(single);
    if (rc != IDEM_OK) {
        idemp_consumer_channel_lost(
            c, "ack failed (committed work will be redelivered and deduplicated)");
        return;
    }
    size_t keep = 0;
    for (size_t i = 0; i < c->nwin; i++) {
        delivery_t *d = c->win[i];
        if (d->state == D_DONE) {
            c->win_bytes -= d->bytes;
            delivery_free(d);
        } else {
            c->win[keep++] = d;
        }
    }
    c->nwin = keep;
}

static bool window_add(idem_consumer_t *c, delivery_t *d)
{
    if (idemp_fault_fail("consumer.nomem_window"))
        return false; /* testing: an allocation failure at this point */
    if (c->nwin == c->capwin) {
        size_t cap = c->capwin ? c->capwin * 2 : 256;
        delivery_t **w = realloc(c->win, cap * sizeof *w);
        if (w == NULL)
            return false;
        c->win = w;
        c->capwin = cap;
    }
    c->win[c->nwin++] = d;
    c->win_bytes += d->bytes;
    return true;
}

/* Reads new deliveries into the window: waits up to first_wait_ms for the first, then lingers
 * for batch-mates. Returns false when the channel was lost (the window is then empty). */
bool idemp_consumer_read(idem_consumer_t *c, int64_t first_wait_ms, bool linger)
{
    int64_t budget = 4 * c->cfg.max_message_bytes;
    if (budget < WINDOW_BYTES_MIN)
        budget = WINDOW_BYTES_MIN;
    int64_t first_deadline = idemp_now_ms() + first_wait_ms, linger_deadline = -1;
    size_t got = 0;
    if ((int64_t)c->win_bytes >= budget) {
        /* enough in memory: let the broker hold the rest, keep the link alive */
        idemp_amqp_keepalive(c->in);
        idemp_amqp_keepalive(c->out);
        idemp_sleep_ms(first_wait_ms, c->cfg.stop);
        return true;
    }
    while (got < (size_t)c->cfg.batch_max && (int64_t)c->win_bytes < budget) {
        int64_t now = idemp_now_ms(), timeout;
        if (got == 0) {
            timeout = first_deadline - now;
        } else {
            if (linger_deadline < 0)
                linger_deadline = now + (linger ? c->cfg.linger_ms : 0);
            timeout = idemp_amqp_buffered(c->in) ? 0 : linger_deadline - now;
        }
        idemp_msg_t *m = NULL;
        idem_error_t err = {0};
        int rc =
            idemp_amqp_next(c->in, c->cfg.max_message_bytes, timeout < 0 ? 0 : timeout, &m, &err);
        if (rc == IDEM_ERR_TIMEOUT)
            return true;
        if (rc != IDEM_OK) {
            idemp_consumer_channel_lost(c, err.text);
            return false;
        }
        delivery_t *d = calloc(1, sizeof *d);
        if (d != NULL) {
            d->msg = m;
            d->tag = idemp_msg_tag(m);
            d->bytes = idemp_msg_oversized(m) ? 0 : (size_t)idemp_msg_body_size(m);
        }
        if (d == NULL || !window_add(c, d)) {
            if (d != NULL)
                d->msg = NULL;
            free(d);
            idemp_msg_free(m);
            /* the delivery cannot be kept: give back everything unacked rather than ack it */
            idemp_consumer_channel_lost(c, "out of memory holding a delivery");
            return false;
        }
        validate(c, d);
        /* an oversized body is still on the wire: it goes to the DLQ before anything else */
        if (idemp_msg_oversized(m) && dead_letter(c, d) != IDEM_OK) {
            idemp_consumer_channel_lost(c, "an oversized message could not be dead-lettered");
            return false;
        }
        got++;
        if (idemp_consumer_stopping(c))
            break;
    }
    return true;
}
