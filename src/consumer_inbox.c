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
#include "uuid.h"

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

/* A fence (see sql/006_partition_routes.sql): published by a consumer of the group straight to
 * one partition (the default exchange), with its id and subscription in headers and no body.
 * Anything else is validated as an event. */
static bool take_fence(idem_consumer_t *c, delivery_t *d)
{
    if (c->cfg.partitions < 2 || !idemp_msg_from_exchange(d->msg, "") ||
        idemp_msg_body_size(d->msg) != 0)
        return false;
    size_t flen = 0, slen = 0;
    const char *f = idemp_msg_header(d->msg, "x-idem-fence", &flen);
    const char *s = idemp_msg_header(d->msg, "subscription_id", &slen);
    if (f == NULL || s == NULL || !idemp_uuid_normalize(f, flen, d->fence_id) ||
        !idemp_uuid_normalize(s, slen, d->ev.subscription_id)) {
        d->fence_id[0] = d->ev.subscription_id[0] = '\0';
        return false;
    }
    d->fence = true;
    memcpy(d->ev.event_id, d->fence_id, sizeof d->ev.event_id);
    snprintf(d->ev.event_type, sizeof d->ev.event_type, "idem.fence");
    d->state = D_READY;
    return true;
}

static void validate(idem_consumer_t *c, delivery_t *d)
{
    d->part = -1;
    d->moved_from = -1;
    for (int i = 0; i < c->nqueues; i++)
        if (idemp_msg_from_queue(d->msg, c->queues[i])) {
            d->qidx = i;
            d->part = c->queue_part[i];
            break;
        }
    if (take_fence(c, d))
        return;
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

/* Records fence_id as reached without a fence message: the old partition does not exist (P was
 * changed), so nothing earlier can be waiting in it. */
static int fence_reached_here(idem_consumer_t *c, const char *fence_id, idem_error_t *err)
{
    char arr[48];
    snprintf(arr, sizeof arr, "{%s}", fence_id);
    const char *p[] = {c->consumer, arr};
    if (c->pg == NULL) /* every connection has a COMMIT on its way: next turn */
        return idem_error_set(err, IDEM_ERR_PG_LOST, "no PostgreSQL connection free");
    return idemp_pg_exec(c->pg,
                         "INSERT INTO idem_partition_fences (consumer, fence_id) "
                         "SELECT $1, f FROM unnest($2::uuid[]) AS f ON CONFLICT DO NOTHING",
                         2, p, NULL, err);
}

/* A MOVED delivery's fence, into its subscription's old partition; the delivery then WAITs
 * for it (consumer_tx.c). On failure it stays MOVED and the fence is tried again next turn. */
static void publish_fence(idem_consumer_t *c, delivery_t *d)
{
    char id[37], queue[256];
    if (!idemp_uuid_random(id))
        return;
    snprintf(queue, sizeof queue, "%s.p%d", c->queue, d->moved_from);
    idem_error_t err = {0};
    int rc = idemp_amqp_publish_fence(c->out, "", queue, id, d->ev.subscription_id,
                                      CONFIRM_TIMEOUT_MS, &err);
    if (rc == IDEM_ERR_NOT_FOUND) {
        err = (idem_error_t){0};
        rc = fence_reached_here(c, id, &err);
    }
    if (rc != IDEM_OK) {
        idemp_consumer_log(IDEM_LOG_WARN, c, d, "publishing a fence to %s failed, will retry: %s",
                           queue, err.text);
        if (rc != IDEM_ERR_PG_QUERY && rc != IDEM_ERR_PG_LOST && rc != IDEM_ERR_PG_CONNECT)
            idemp_amqp_disconnect(c->out, err.text);
        return;
    }
    memcpy(d->fence_id, id, sizeof d->fence_id);
    d->state = D_WAIT;
    d->due_ms = idemp_now_ms();
    idemp_consumer_log(IDEM_LOG_INFO, c, d,
                       "subscription %s moved from partition %d to %d (RabbitMQ's hash ring "
                       "changed): its events here wait until partition %d has applied the earlier "
                       "ones (fence %s)",
                       d->ev.subscription_id, d->moved_from, d->part, d->moved_from, id);
}

void idemp_consumer_publish_fences(idem_consumer_t *c)
{
    for (size_t i = 0; i < c->nwin && idemp_amqp_connected(c->out); i++) {
        delivery_t *d = c->win[i];
        if (d->state != D_MOVED)
            continue;
        /* a later event of the subscription waits for the fence of an earlier one */
        uint64_t k = idemp_window_key(d);
        const delivery_t *first = NULL;
        for (size_t j = 0; j < i && first == NULL; j++)
            if (c->win[j]->fence_id[0] && !c->win[j]->fence && c->win[j]->moved_from >= 0 &&
                (c->win[j]->state == D_WAIT || c->win[j]->state == D_MOVED) &&
                idemp_window_key(c->win[j]) == k && c->win[j]->moved_from == d->moved_from)
                first = c->win[j];
        if (first != NULL) {
            memcpy(d->fence_id, first->fence_id, sizeof d->fence_id);
            d->state = D_WAIT;
            d->due_ms = first->due_ms;
        } else {
            publish_fence(c, d);
        }
    }
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
