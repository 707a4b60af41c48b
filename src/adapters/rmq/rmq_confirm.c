/* rmq_confirm.c - publisher confirms: sequence numbers, acks and nacks (also out of order),
 * returns, and servicing a link that publishes. */
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "rmq_int.h"

/* ---- confirms ----------------------------------------------------------------------------- */

void idemp_amqp_published(idemp_amqp_t *a, uint64_t *tag)
{
    if (tag != NULL)
        *tag = a->next_tag;
    a->next_tag++;
    a->last_send = idemp_now_ms();
}

/* Records that tag (or every tag up to it) is settled and advances a->confirmed. */
static void settle(idemp_amqp_t *a, uint64_t tag, bool multiple)
{
    if (tag <= a->confirmed)
        return;
    if (multiple) {
        uint64_t shift = tag - a->confirmed;
        if (shift >= a->settled_cap) {
            if (a->settled != NULL)
                memset(a->settled, 0, a->settled_cap);
        } else {
            memmove(a->settled, a->settled + shift, a->settled_cap - shift);
            memset(a->settled + a->settled_cap - shift, 0, shift);
        }
        a->confirmed = tag;
    } else {
        size_t idx = (size_t)(tag - a->confirmed - 1);
        if (idx >= a->settled_cap) {
            size_t cap = a->settled_cap ? a->settled_cap : 1024;
            while (cap <= idx)
                cap *= 2;
            uint8_t *p = realloc(a->settled, cap);
            if (p == NULL)
                return; /* the wait then times out and the batch is retried: safe */
            memset(p + a->settled_cap, 0, cap - a->settled_cap);
            a->settled = p;
            a->settled_cap = cap;
        }
        a->settled[idx] = 1;
    }
    size_t run = 0;
    while (run < a->settled_cap && a->settled[run])
        run++;
    if (run > 0) {
        memmove(a->settled, a->settled + run, a->settled_cap - run);
        memset(a->settled + a->settled_cap - run, 0, run);
        a->confirmed += run;
    }
}

/* Handles one frame on a publishing connection: a confirm, a return or a close. */
static int confirm_frame(idemp_amqp_t *a, amqp_frame_t *f, idemp_confirm_fn fn, void *ud,
                         idem_error_t *err)
{
    if (f->frame_type != AMQP_FRAME_METHOD)
        return IDEM_OK;
    switch (f->payload.method.id) {
    case AMQP_BASIC_ACK_METHOD: {
        amqp_basic_ack_t *m = f->payload.method.decoded;
        if (fn != NULL)
            fn(ud, IDEMP_CONFIRM_ACK, m->delivery_tag, m->multiple, NULL, 0);
        settle(a, m->delivery_tag, m->multiple);
        break;
    }
    case AMQP_BASIC_NACK_METHOD: {
        amqp_basic_nack_t *m = f->payload.method.decoded;
        if (fn != NULL)
            fn(ud, IDEMP_CONFIRM_NACK, m->delivery_tag, m->multiple, NULL, 0);
        settle(a, m->delivery_tag, m->multiple);
        break;
    }
    case AMQP_BASIC_RETURN_METHOD: {
        amqp_message_t msg;
        amqp_rpc_reply_t r = amqp_read_message(a->conn, f->channel, &msg, 0);
        if (r.reply_type != AMQP_RESPONSE_NORMAL)
            return idemp_amqp_check_rpc(a, r, "basic.return", err);
        const amqp_basic_properties_t *p = &msg.properties;
        bool has_id = (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG) != 0;
        if (fn != NULL)
            fn(ud, IDEMP_CONFIRM_RETURN, 0, false, has_id ? p->message_id.bytes : NULL,
               has_id ? p->message_id.len : 0);
        amqp_destroy_message(&msg);
        break;
    }
    case AMQP_CHANNEL_CLOSE_METHOD:
    case AMQP_CONNECTION_CLOSE_METHOD:
        return idemp_amqp_on_close(a, f, err);
    default:
        break;
    }
    return IDEM_OK;
}

int idemp_amqp_wait_confirms(idemp_amqp_t *a, uint64_t last_tag, int64_t timeout_ms,
                             idemp_confirm_fn fn, void *ud, idem_error_t *err)
{
    int64_t deadline = idemp_now_ms() + timeout_ms;
    while (a->confirmed < last_tag) {
        int64_t left = deadline - idemp_now_ms();
        amqp_frame_t f;
        int rc = idemp_amqp_wait_frame(a, &f, left > 0 ? left : 0, err);
        if (rc == IDEM_ERR_TIMEOUT) {
            if (left > 0)
                continue;
            return IDEM_ERR_TIMEOUT;
        }
        if (rc == IDEM_OK)
            rc = confirm_frame(a, &f, fn, ud, err);
        if (rc != IDEM_OK)
            return rc;
    }
    amqp_maybe_release_buffers(a->conn);
    return IDEM_OK;
}

struct one_wait {
    uint64_t tag;
    bool failed;
};

static void on_one(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                   const char *message_id, size_t len)
{
    struct one_wait *w = ud;
    if (kind == IDEMP_CONFIRM_RETURN ||
        (kind == IDEMP_CONFIRM_NACK && (multiple ? w->tag <= tag : w->tag == tag)))
        w->failed = true;
}

int idemp_amqp_confirm_one(idemp_amqp_t *a, uint64_t tag, int64_t timeout_ms, idem_error_t *err)
{
    struct one_wait w = {tag, false};
    int rc = idemp_amqp_wait_confirms(a, tag, timeout_ms, on_one, &w, err);
    if (rc == IDEM_ERR_TIMEOUT)
        return idem_error_set(err, IDEM_ERR_TIMEOUT,
                              "no publisher confirm from RabbitMQ at %s within %lld ms", a->where,
                              (long long)timeout_ms);
    if (rc == IDEM_OK && w.failed)
        return idem_error_set(err, IDEM_ERR_AMQP, "RabbitMQ at %s did not take the message",
                              a->where);
    return rc;
}

int idemp_amqp_take_confirms(idemp_amqp_t *a, idemp_confirm_fn fn, void *ud, idem_error_t *err)
{
    for (;;) {
        amqp_frame_t f;
        int rc = idemp_amqp_wait_frame(a, &f, 0, err);
        if (rc == IDEM_ERR_TIMEOUT)
            break;
        if (rc == IDEM_OK)
            rc = confirm_frame(a, &f, fn, ud, err);
        if (rc != IDEM_OK)
            return rc;
    }
    if (a->connected)
        amqp_maybe_release_buffers(a->conn);
    idemp_amqp_keepalive(a);
    return IDEM_OK;
}

int idemp_amqp_service(idemp_amqp_t *a, idem_error_t *err)
{
    return idemp_amqp_take_confirms(a, NULL, NULL, err);
}
