/* rmq_deliver.c - deliveries: read frame by frame (the body size is known before the body is
 * read), copied out of the connection's buffers, and mapped to envelope fields. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include <idem/log.h>

#include "clock.h"
#include "rmq_int.h"

/* A content header and body frames follow their basic.deliver at once: a longer silence is a
 * broken link (heartbeats keep a healthy one talking). */
#define FRAME_WAIT_MS 30000

/* ---- properties --------------------------------------------------------------------------- */

static int dup_bytes(amqp_pool_t *pool, amqp_bytes_t src, amqp_bytes_t *dst)
{
    if (src.len == 0) {
        *dst = amqp_empty_bytes;
        return AMQP_STATUS_OK;
    }
    amqp_pool_alloc_bytes(pool, src.len, dst);
    if (dst->bytes == NULL)
        return AMQP_STATUS_NO_MEMORY;
    memcpy(dst->bytes, src.bytes, src.len);
    return AMQP_STATUS_OK;
}

static int clone_value(const amqp_field_value_t *src, amqp_field_value_t *dst, amqp_pool_t *pool);

/* amqp_table_clone refuses an entry with an empty name, which AMQP allows and RabbitMQ passes
 * on: this copy keeps every entry (the headers are read again only by name). */
static int clone_table(const amqp_table_t *src, amqp_table_t *dst, amqp_pool_t *pool)
{
    dst->num_entries = src->num_entries;
    dst->entries = NULL;
    if (src->num_entries <= 0)
        return AMQP_STATUS_OK;
    dst->entries = amqp_pool_alloc(pool, (size_t)src->num_entries * sizeof *dst->entries);
    if (dst->entries == NULL)
        return AMQP_STATUS_NO_MEMORY;
    for (int i = 0; i < src->num_entries; i++) {
        int rc = dup_bytes(pool, src->entries[i].key, &dst->entries[i].key);
        if (rc == AMQP_STATUS_OK)
            rc = clone_value(&src->entries[i].value, &dst->entries[i].value, pool);
        if (rc != AMQP_STATUS_OK)
            return rc;
    }
    return AMQP_STATUS_OK;
}

static int clone_value(const amqp_field_value_t *src, amqp_field_value_t *dst, amqp_pool_t *pool)
{
    *dst = *src;
    switch (src->kind) {
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES:
        return dup_bytes(pool, src->value.bytes, &dst->value.bytes);
    case AMQP_FIELD_KIND_TABLE:
        return clone_table(&src->value.table, &dst->value.table, pool);
    case AMQP_FIELD_KIND_ARRAY: {
        const amqp_array_t *a = &src->value.array;
        amqp_array_t *b = &dst->value.array;
        b->entries = NULL;
        if (a->num_entries <= 0)
            return AMQP_STATUS_OK;
        b->entries = amqp_pool_alloc(pool, (size_t)a->num_entries * sizeof *b->entries);
        if (b->entries == NULL)
            return AMQP_STATUS_NO_MEMORY;
        for (int i = 0; i < a->num_entries; i++) {
            int rc = clone_value(&a->entries[i], &b->entries[i], pool);
            if (rc != AMQP_STATUS_OK)
                return rc;
        }
        return AMQP_STATUS_OK;
    }
    default:
        return AMQP_STATUS_OK; /* scalars live in the value itself */
    }
}

/* Deep copy of decoded properties into pool (librabbitmq 0.11 does not export its own). */
static int clone_props(const amqp_basic_properties_t *src, amqp_basic_properties_t *dst,
                       amqp_pool_t *pool)
{
    *dst = *src;
    int rc = AMQP_STATUS_OK;
#define CLONE(flag, field)                                                                         \
    if (rc == AMQP_STATUS_OK && (src->_flags & (flag)))                                            \
    rc = dup_bytes(pool, src->field, &dst->field)
    CLONE(AMQP_BASIC_CONTENT_TYPE_FLAG, content_type);
    CLONE(AMQP_BASIC_CONTENT_ENCODING_FLAG, content_encoding);
    CLONE(AMQP_BASIC_CORRELATION_ID_FLAG, correlation_id);
    CLONE(AMQP_BASIC_REPLY_TO_FLAG, reply_to);
    CLONE(AMQP_BASIC_EXPIRATION_FLAG, expiration);
    CLONE(AMQP_BASIC_MESSAGE_ID_FLAG, message_id);
    CLONE(AMQP_BASIC_TYPE_FLAG, type);
    CLONE(AMQP_BASIC_USER_ID_FLAG, user_id);
    CLONE(AMQP_BASIC_APP_ID_FLAG, app_id);
    CLONE(AMQP_BASIC_CLUSTER_ID_FLAG, cluster_id);
#undef CLONE
    if (rc == AMQP_STATUS_OK && (src->_flags & AMQP_BASIC_HEADERS_FLAG))
        rc = clone_table(&src->headers, &dst->headers, pool);
    return rc;
}

static const amqp_field_value_t *header(const amqp_basic_properties_t *p, const char *name)
{
    if (!(p->_flags & AMQP_BASIC_HEADERS_FLAG))
        return NULL;
    size_t n = strlen(name);
    for (int i = 0; i < p->headers.num_entries; i++) {
        const amqp_table_entry_t *e = &p->headers.entries[i];
        if (e->key.len == n && (n == 0 || memcmp(e->key.bytes, name, n) == 0))
            return &e->value; /* an empty name's bytes may be NULL */
    }
    return NULL;
}

static bool is_string(const amqp_field_value_t *v)
{
    return v->kind == AMQP_FIELD_KIND_UTF8 || v->kind == AMQP_FIELD_KIND_BYTES;
}

static idemp_str_t str_of(amqp_bytes_t b)
{
    return (idemp_str_t){b.bytes, b.len};
}

static idemp_str_t header_str(const amqp_basic_properties_t *p, const char *name, bool *bad)
{
    const amqp_field_value_t *v = header(p, name);
    if (bad != NULL)
        *bad = v != NULL && !is_string(v);
    if (v == NULL || !is_string(v))
        return (idemp_str_t){NULL, 0};
    return str_of(v->value.bytes);
}

static bool header_int(const amqp_basic_properties_t *p, const char *name, int64_t *out)
{
    const amqp_field_value_t *v = header(p, name);
    if (v == NULL)
        return false;
    switch (v->kind) {
    case AMQP_FIELD_KIND_I8:
        *out = v->value.i8;
        return true;
    case AMQP_FIELD_KIND_U8:
        *out = v->value.u8;
        return true;
    case AMQP_FIELD_KIND_I16:
        *out = v->value.i16;
        return true;
    case AMQP_FIELD_KIND_U16:
        *out = v->value.u16;
        return true;
    case AMQP_FIELD_KIND_I32:
        *out = v->value.i32;
        return true;
    case AMQP_FIELD_KIND_U32:
        *out = v->value.u32;
        return true;
    case AMQP_FIELD_KIND_I64:
        *out = v->value.i64;
        return true;
    case AMQP_FIELD_KIND_U64:
        if (v->value.u64 > (uint64_t)INT64_MAX)
            return false;
        *out = (int64_t)v->value.u64;
        return true;
    default:
        return false;
    }
}

/* ---- deliveries ---------------------------------------------------------------------------- */

void idemp_msg_free(idemp_msg_t *m)
{
    if (m == NULL)
        return;
    amqp_bytes_free(m->body);
    empty_amqp_pool(&m->pool);
    free(m);
}

uint64_t idemp_msg_tag(const idemp_msg_t *m)
{
    return m->tag;
}

bool idemp_msg_oversized(const idemp_msg_t *m)
{
    return m->oversized;
}

uint64_t idemp_msg_body_size(const idemp_msg_t *m)
{
    return m->body_size;
}

void idemp_msg_envelope_in(const idemp_msg_t *m, idemp_envelope_in_t *in)
{
    const amqp_basic_properties_t *p = &m->props;
    memset(in, 0, sizeof *in);
    if (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG)
        in->message_id = str_of(p->message_id);
    if (p->_flags & AMQP_BASIC_USER_ID_FLAG)
        in->user_id = str_of(p->user_id);
    in->hdr_event_id = header_str(p, "event_id", &in->hdr_event_id_bad_kind);
    if (p->_flags & AMQP_BASIC_TYPE_FLAG)
        in->type = str_of(p->type);
    in->hdr_event_type = header_str(p, "event_type", NULL);
    in->routing_key = str_of(m->routing_key);
    in->hdr_subscription_id = header_str(p, "subscription_id", NULL);
    in->has_seq = header_int(p, "x-idem-seq", &in->seq);
    if (p->_flags & AMQP_BASIC_TIMESTAMP_FLAG) {
        in->has_timestamp = true;
        in->timestamp = p->timestamp;
    }
    in->body = m->oversized ? NULL : (m->body.bytes ? (const char *)m->body.bytes : "");
    in->body_len = m->oversized ? 0 : m->body.len;
    in->body_size = m->body_size;
}

const char *idemp_msg_header(const idemp_msg_t *m, const char *name, size_t *len)
{
    idemp_str_t s = header_str(&m->props, name, NULL);
    if (len != NULL)
        *len = s.len;
    return s.ptr;
}

char *idemp_msg_headers_json(const idemp_msg_t *m)
{
    json_t *o = json_object();
    if (o == NULL)
        return NULL;
    const amqp_basic_properties_t *p = &m->props;
    if (p->_flags & AMQP_BASIC_HEADERS_FLAG) {
        for (int i = 0; i < p->headers.num_entries; i++) {
            const amqp_table_entry_t *e = &p->headers.entries[i];
            json_t *v = NULL;
            char key[256];
            snprintf(key, sizeof key, "%.*s", (int)e->key.len,
                     e->key.len > 0 ? (const char *)e->key.bytes : "");
            int64_t iv;
            const amqp_bytes_t *b = &e->value.value.bytes;
            if (is_string(&e->value) && (b->len == 0 || memchr(b->bytes, '\0', b->len) == NULL))
                v = json_stringn(b->bytes, b->len);
            else if (header_int(p, key, &iv))
                v = json_integer(iv); /* x-idem-seq */
            if (v == NULL)
                continue; /* not UTF-8, a NUL (jsonb has none), or a kind JSON has no place for */
            if (strlen(key) != e->key.len)
                json_decref(v); /* a name with NUL inside */
            else
                json_object_set_new(o, key, v); /* steals v, also when it fails */
        }
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* The next frame of the message being read: a content header or body frame on our channel.
 * A close is answered; anything else breaks the protocol. */
int idemp_amqp_content_frame(idemp_amqp_t *a, int want, amqp_frame_t *f, idem_error_t *err)
{
    int rc = idemp_amqp_wait_frame(a, f, FRAME_WAIT_MS, err);
    if (rc == IDEM_ERR_TIMEOUT)
        return idemp_amqp_lost(a, AMQP_STATUS_TIMEOUT, "reading a message", err);
    if (rc != IDEM_OK)
        return rc;
    if (f->frame_type == want && f->channel == IDEMP_CHANNEL)
        return IDEM_OK;
    if (f->frame_type == AMQP_FRAME_METHOD &&
        (f->payload.method.id == AMQP_CHANNEL_CLOSE_METHOD ||
         f->payload.method.id == AMQP_CONNECTION_CLOSE_METHOD))
        return idemp_amqp_on_close(a, f, err);
    return idemp_amqp_lost(a, AMQP_STATUS_UNEXPECTED_STATE, "reading a message", err);
}

/* Reads and drops what is left of an unread body. */
static int skip_body(idemp_amqp_t *a, idem_error_t *err)
{
    while (a->body_left > 0) {
        amqp_frame_t f;
        int rc = idemp_amqp_content_frame(a, AMQP_FRAME_BODY, &f, err);
        if (rc != IDEM_OK)
            return rc;
        size_t len = f.payload.body_fragment.len;
        a->body_left = len >= a->body_left ? 0 : a->body_left - len;
        amqp_maybe_release_buffers_on_channel(a->conn, IDEMP_CHANNEL);
    }
    return IDEM_OK;
}

/* Reads the content of a message whose method (deliver or get-ok) was just read. */
static int read_message(idemp_amqp_t *a, uint64_t tag, bool redelivered, amqp_bytes_t exchange,
                        amqp_bytes_t routing_key, amqp_bytes_t consumer_tag, int64_t max_body,
                        idemp_msg_t **out, idem_error_t *err)
{
    idemp_msg_t *m = calloc(1, sizeof *m);
    if (m == NULL) {
        a->connected = false; /* the content is still on the wire */
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory reading a delivery");
    }
    init_amqp_pool(&m->pool, 4096);
    m->tag = tag;
    m->redelivered = redelivered;
    int rc = dup_bytes(&m->pool, exchange, &m->exchange);
    if (rc == AMQP_STATUS_OK)
        rc = dup_bytes(&m->pool, routing_key, &m->routing_key);
    if (rc == AMQP_STATUS_OK)
        rc = dup_bytes(&m->pool, consumer_tag, &m->consumer_tag);
    amqp_frame_t f;
    int st =
        rc == AMQP_STATUS_OK ? idemp_amqp_content_frame(a, AMQP_FRAME_HEADER, &f, err) : IDEM_OK;
    if (rc == AMQP_STATUS_OK && st == IDEM_OK)
        rc = clone_props(f.payload.properties.decoded, &m->props, &m->pool);
    if (rc != AMQP_STATUS_OK) {
        idemp_msg_free(m);
        /* the rest of the message is still on the wire: only a new connection gets past it */
        a->connected = false;
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory reading a delivery");
    }
    if (st != IDEM_OK) {
        idemp_msg_free(m);
        return st;
    }
    m->body_size = f.payload.properties.body_size;
    if (m->body_size > (uint64_t)max_body) {
        m->oversized = true;
        a->body_left = m->body_size;
        *out = m;
        return IDEM_OK;
    }
    if (m->body_size > 0) {
        m->body = amqp_bytes_malloc((size_t)m->body_size);
        if (m->body.bytes == NULL) {
            a->body_left = m->body_size;
            idemp_msg_free(m);
            a->connected = false;
            return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory reading a delivery");
        }
    }
    size_t got = 0;
    while (got < m->body.len) {
        st = idemp_amqp_content_frame(a, AMQP_FRAME_BODY, &f, err);
        if (st == IDEM_OK && got + f.payload.body_fragment.len > m->body.len)
            st = idemp_amqp_lost(a, AMQP_STATUS_BAD_AMQP_DATA, "reading a message", err);
        if (st != IDEM_OK) {
            idemp_msg_free(m);
            return st;
        }
        memcpy((char *)m->body.bytes + got, f.payload.body_fragment.bytes,
               f.payload.body_fragment.len);
        got += f.payload.body_fragment.len;
    }
    *out = m;
    return IDEM_OK;
}

int idemp_amqp_next(idemp_amqp_t *a, int64_t max_body, int64_t timeout_ms, idemp_msg_t **out,
                    idem_error_t *err)
{
    *out = NULL;
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    int rc = skip_body(a, err);
    if (rc != IDEM_OK)
        return rc;
    amqp_maybe_release_buffers(a->conn);
    int64_t deadline = idemp_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        amqp_frame_t f;
        rc = idemp_amqp_wait_frame(a, &f, deadline - idemp_now_ms(), err);
        if (rc != IDEM_OK)
            return rc;
        if (f.frame_type != AMQP_FRAME_METHOD)
            return idemp_amqp_lost(a, AMQP_STATUS_UNEXPECTED_STATE, "basic.deliver", err);
        switch (f.payload.method.id) {
        case AMQP_BASIC_DELIVER_METHOD: {
            const amqp_basic_deliver_t *d = f.payload.method.decoded;
            return read_message(a, d->delivery_tag, d->redelivered, d->exchange, d->routing_key,
                                d->consumer_tag, max_body, out, err);
        }
        case AMQP_CHANNEL_CLOSE_METHOD:
        case AMQP_CONNECTION_CLOSE_METHOD:
            return idemp_amqp_on_close(a, &f, err);
        case AMQP_BASIC_CANCEL_METHOD:
            a->connected = false;
            return idem_error_set(err, IDEM_ERR_AMQP,
                                  "the broker cancelled the consumer (queue deleted?)");
        case AMQP_CONNECTION_BLOCKED_METHOD: {
            const char *kv[] = {"server", a->where, NULL};
            idem_log(IDEM_LOG_WARN, a->component, kv,
                     "RabbitMQ blocked this connection (a resource alarm)");
            break;
        }
        default:
            break; /* a stray confirm or an unblock: nothing to do */
        }
    }
}

int idemp_amqp_get(idemp_amqp_t *a, const char *queue, int64_t max_body, idemp_msg_t **out,
                   idem_error_t *err)
{
    *out = NULL;
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_basic_get_t g;
    memset(&g, 0, sizeof g);
    g.queue = amqp_cstring_bytes(queue);
    g.no_ack = 0;
    amqp_method_number_t replies[] = {AMQP_BASIC_GET_OK_METHOD, AMQP_BASIC_GET_EMPTY_METHOD, 0};
    amqp_rpc_reply_t r =
        amqp_simple_rpc(a->conn, IDEMP_CHANNEL, AMQP_BASIC_GET_METHOD, replies, &g);
    if (r.reply_type != AMQP_RESPONSE_NORMAL)
        return idemp_amqp_check_rpc(a, r, "basic.get", err);
    if (r.reply.id == AMQP_BASIC_GET_EMPTY_METHOD)
        return IDEM_ERR_NOT_FOUND;
    const amqp_basic_get_ok_t *ok = r.reply.decoded;
    return read_message(a, ok->delivery_tag, ok->redelivered, ok->exchange, ok->routing_key,
                        amqp_empty_bytes, max_body, out, err);
}

static bool bytes_are(amqp_bytes_t b, const char *s)
{
    size_t n = strlen(s);
    return b.len == n && (n == 0 || memcmp(b.bytes, s, n) == 0);
}

bool idemp_msg_from_queue(const idemp_msg_t *m, const char *queue)
{
    return bytes_are(m->consumer_tag, queue);
}

bool idemp_msg_from_exchange(const idemp_msg_t *m, const char *exchange)
{
    return bytes_are(m->exchange, exchange);
}

bool idemp_msg_header_int(const idemp_msg_t *m, const char *name, int64_t *out)
{
    return header_int(&m->props, name, out);
}

bool idemp_msg_timestamp(const idemp_msg_t *m, uint64_t *out)
{
    if (!(m->props._flags & AMQP_BASIC_TIMESTAMP_FLAG))
        return false;
    *out = m->props.timestamp;
    return true;
}
