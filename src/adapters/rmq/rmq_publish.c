/* rmq_publish.c - publishes: the dead-letter copy (streamed frame by frame when the body was too
 * large to read) and the relay's event messages, each checked to fit before anything is sent. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <openssl/evp.h>

#include "rmq_int.h"
#include "uuid.h"

#define HEADER_FRAME_OVERHEAD 20 /* frame header + end octet + class, weight and body size */

/* The user this connection logged in as (the URL's, also when the password came from a file):
 * RabbitMQ refuses a user_id property that is not exactly it. */
static amqp_bytes_t login_user(const idemp_amqp_t *a)
{
    return amqp_cstring_bytes(a->urls[a->cur].user);
}

/* ---- the dead-letter copy ------------------------------------------------------------------ */

static bool key_is(const amqp_table_entry_t *e, const char *name)
{
    size_t n = strlen(name);
    return e->key.len == n && memcmp(e->key.bytes, name, n) == 0;
}

static amqp_table_entry_t str_entry(const char *key, amqp_bytes_t val)
{
    amqp_table_entry_t e;
    e.key = amqp_cstring_bytes(key);
    e.value.kind = AMQP_FIELD_KIND_UTF8;
    e.value.value.bytes = val;
    return e;
}

/* Size the properties take encoded, or -1 when they do not fit one frame. */
static int encoded_size(idemp_amqp_t *a, amqp_basic_properties_t *p)
{
    if (a->scratch == NULL && (a->scratch = malloc(IDEMP_FRAME_MAX)) == NULL)
        return -1;
    int fmax = a->conn != NULL ? amqp_get_frame_max(a->conn) : IDEMP_FRAME_MAX;
    if (fmax <= 0 || fmax > IDEMP_FRAME_MAX)
        fmax = IDEMP_FRAME_MAX;
    amqp_bytes_t buf = {(size_t)fmax - HEADER_FRAME_OVERHEAD, a->scratch};
    int n = amqp_encode_properties(AMQP_BASIC_CLASS, p, buf);
    return n < 0 ? -1 : n;
}

/* Size of one header entry encoded, for choosing what to drop; a huge value when unknown. */
static size_t entry_size(idemp_amqp_t *a, amqp_table_entry_t *e)
{
    amqp_table_t t = {1, e};
    amqp_basic_properties_t p;
    memset(&p, 0, sizeof p);
    p._flags = AMQP_BASIC_HEADERS_FLAG;
    p.headers = t;
    int n = encoded_size(a, &p);
    return n < 0 ? (size_t)IDEMP_FRAME_MAX : (size_t)n;
}

/* Builds the dead-letter properties of m into p, with entries (capacity n + 4) as its headers. */
static int dl_props(idemp_amqp_t *out, idemp_msg_t *m, const char *reason,
                    amqp_basic_properties_t *p, amqp_table_entry_t *entries, char *dropped,
                    size_t dropped_sz)
{
    *p = m->props;
    int old = (p->_flags & AMQP_BASIC_HEADERS_FLAG) ? p->headers.num_entries : 0;
    bool had_exp = (p->_flags & AMQP_BASIC_EXPIRATION_FLAG) != 0;
    bool had_uid = (p->_flags & AMQP_BASIC_USER_ID_FLAG) != 0;
    int nkeep = 0;
    for (int i = 0; i < old; i++) {
        amqp_table_entry_t *e = &m->props.headers.entries[i];
        /* a message dead-lettered again carries only its latest reason */
        if (key_is(e, "x-idem-error") || key_is(e, "x-idem-dropped-headers") ||
            (had_exp && key_is(e, "x-idem-original-expiration")) ||
            (had_uid && key_is(e, "x-idem-original-user-id")))
            continue;
        entries[nkeep++] = *e;
    }
    int n = nkeep;
    if (had_exp)
        entries[n++] = str_entry("x-idem-original-expiration", m->props.expiration);
    if (had_uid)
        entries[n++] = str_entry("x-idem-original-user-id", m->props.user_id);
    /* a copy must outlive restarts and expiry, and another user must be able to publish it */
    p->_flags &= ~(AMQP_BASIC_EXPIRATION_FLAG | AMQP_BASIC_USER_ID_FLAG);
    p->_flags |= AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_HEADERS_FLAG;
    p->delivery_mode = 2;
    int err_at = n;
    entries[n++] = str_entry("x-idem-error", amqp_cstring_bytes(reason));
    p->headers.entries = entries;
    p->headers.num_entries = n;
    if (encoded_size(out, p) >= 0)
        return IDEM_OK;

    /* too big for one frame: a shorter reason, then drop the largest original headers */
    amqp_bytes_t r = amqp_cstring_bytes(reason);
    if (r.len > 200)
        r.len = 200;
    entries[err_at].value.value.bytes = r;
    size_t dl = 0;
    dropped[0] = '\0';
    while (encoded_size(out, p) < 0) {
        int big = -1;
        size_t bigsz = 0;
        for (int i = 0; i < nkeep; i++) {
            size_t s = entry_size(out, &entries[i]);
            if (big < 0 || s > bigsz) {
                big = i;
                bigsz = s;
            }
        }
        if (big < 0)
            return IDEM_ERR_UNENCODABLE; /* only our own headers left, and they do not fit */
        int w = snprintf(dropped + dl, dropped_sz - dl, "%s%.*s", dl ? "," : "",
                         (int)entries[big].key.len, (const char *)entries[big].key.bytes);
        if (w > 0 && (size_t)w < dropped_sz - dl)
            dl += (size_t)w;
        memmove(&entries[big], &entries[big + 1], (size_t)(n - big - 1) * sizeof *entries);
        nkeep--;
        n--;
        err_at--;
        if (n > 0 && key_is(&entries[n - 1], "x-idem-dropped-headers"))
            entries[n - 1].value.value.bytes = amqp_cstring_bytes(dropped);
        else
            entries[n++] = str_entry("x-idem-dropped-headers", amqp_cstring_bytes(dropped));
        p->headers.num_entries = n;
    }
    return IDEM_OK;
}

/* Sends the content of an oversized message: the header frame, then its body frames as they are
 * read from in, one at a time. */
static int stream_body(idemp_amqp_t *out, idemp_amqp_t *in, idemp_msg_t *m,
                       amqp_basic_properties_t *p, idem_error_t *err)
{
    amqp_frame_t h;
    memset(&h, 0, sizeof h);
    h.frame_type = AMQP_FRAME_HEADER;
    h.channel = IDEMP_CHANNEL;
    h.payload.properties.class_id = AMQP_BASIC_CLASS;
    h.payload.properties.body_size = m->body_size;
    h.payload.properties.decoded = p;
    int st = amqp_send_frame(out->conn, &h);
    if (st != AMQP_STATUS_OK)
        return idemp_amqp_lost(out, st, "dead-letter header", err);
    size_t chunk = (size_t)amqp_get_frame_max(out->conn) - HEADER_FRAME_OVERHEAD;
    while (in->body_left > 0) {
        amqp_frame_t f;
        int rc = idemp_amqp_content_frame(in, AMQP_FRAME_BODY, &f, err);
        if (rc != IDEM_OK) {
            out->connected = false; /* half a message was sent: this link is unusable */
            return rc;
        }
        size_t len = f.payload.body_fragment.len;
        in->body_left = len >= in->body_left ? 0 : in->body_left - len;
        for (size_t off = 0; off < len; off += chunk) {
            amqp_frame_t b;
            memset(&b, 0, sizeof b);
            b.frame_type = AMQP_FRAME_BODY;
            b.channel = IDEMP_CHANNEL;
            b.payload.body_fragment.bytes = (char *)f.payload.body_fragment.bytes + off;
            b.payload.body_fragment.len = len - off < chunk ? len - off : chunk;
            st = amqp_send_frame(out->conn, &b);
            if (st != AMQP_STATUS_OK)
                return idemp_amqp_lost(out, st, "dead-letter body", err);
        }
        amqp_maybe_release_buffers_on_channel(in->conn, IDEMP_CHANNEL);
    }
    return IDEM_OK;
}

int idemp_amqp_dead_letter(idemp_amqp_t *out, idemp_amqp_t *in, idemp_msg_t *m,
                           const char *exchange, const char *routing_key, const char *reason,
                           int64_t timeout_ms, idem_error_t *err)
{
    if (!out->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s",
                              out->where);
    bool streaming = m->oversized && m->body.bytes == NULL && m->body_size > 0;
    if (streaming && (in == NULL || !in->connected || in->body_left != m->body_size))
        return idem_error_set(err, IDEM_ERR_AMQP_LOST,
                              "the body of an oversized message is no longer on the wire");
    int old = (m->props._flags & AMQP_BASIC_HEADERS_FLAG) ? m->props.headers.num_entries : 0;
    amqp_table_entry_t *entries = calloc((size_t)old + 4, sizeof *entries);
    char dropped[1024];
    if (entries == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    amqp_basic_properties_t p;
    int rc = dl_props(out, m, reason, &p, entries, dropped, sizeof dropped);
    if (rc != IDEM_OK) {
        free(entries);
        return idem_error_set(err, rc, "the dead-letter copy cannot be encoded");
    }
    int st;
    if (!streaming) {
        st = amqp_basic_publish(out->conn, IDEMP_CHANNEL, amqp_cstring_bytes(exchange),
                                amqp_cstring_bytes(routing_key), 1, 0, &p, m->body);
        rc = st == AMQP_STATUS_OK ? IDEM_OK : idemp_amqp_lost(out, st, "dead-letter publish", err);
    } else {
        amqp_basic_publish_t pm;
        memset(&pm, 0, sizeof pm);
        pm.exchange = amqp_cstring_bytes(exchange);
        pm.routing_key = amqp_cstring_bytes(routing_key);
        pm.mandatory = 1;
        st = amqp_send_method(out->conn, IDEMP_CHANNEL, AMQP_BASIC_PUBLISH_METHOD, &pm);
        rc = st == AMQP_STATUS_OK ? stream_body(out, in, m, &p, err)
                                  : idemp_amqp_lost(out, st, "dead-letter publish", err);
    }
    free(entries);
    if (rc != IDEM_OK)
        return rc;
    uint64_t tag;
    idemp_amqp_published(out, &tag);
    return idemp_amqp_confirm_one(out, tag, timeout_ms, err);
}

/* ---- event publishes (the relay) ------------------------------------------------------------ */

int idemp_amqp_shard(const char *subscription_id)
{
    char canon[37];
    if (subscription_id == NULL ||
        !idemp_uuid_normalize(subscription_id, strlen(subscription_id), canon))
        return -1;
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    if (EVP_Digest(canon, 36, md, &mdlen, EVP_md5(), NULL) != 1 || mdlen < 4)
        return -1;
    uint32_t v = (uint32_t)md[0] << 24 | (uint32_t)md[1] << 16 | (uint32_t)md[2] << 8 | md[3];
    return (int)(v % IDEMP_SHARDS);
}

int idemp_amqp_publish_event(idemp_amqp_t *a, const char *exchange, const idemp_event_msg_t *e,
                             uint64_t *tag, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    size_t tlen = strlen(e->event_type);
    if (tlen == 0 || tlen > 255)
        return idem_error_set(err, IDEM_ERR_UNENCODABLE,
                              "event type is %zu bytes; an AMQP routing key holds 1-255", tlen);
    json_t *extra = NULL;
    if (e->headers_json != NULL && e->headers_json[0] != '\0') {
        extra = json_loads(e->headers_json, 0, NULL);
        if (!json_is_object(extra)) {
            json_decref(extra);
            return idem_error_set(err, IDEM_ERR_UNENCODABLE, "headers are not a JSON object");
        }
    }
    size_t nextra = extra ? json_object_size(extra) : 0;
    amqp_table_entry_t fixed[5];
    amqp_table_entry_t *h = nextra ? calloc(5 + nextra, sizeof *h) : fixed;
    if (h == NULL) {
        json_decref(extra);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    int n = 0;
    h[n++] = str_entry("event_id", amqp_cstring_bytes(e->event_id));
    h[n++] = str_entry("subscription_id", amqp_cstring_bytes(e->subscription_id));
    h[n++] = str_entry("event_type", amqp_cstring_bytes(e->event_type));
    h[n].key = amqp_cstring_bytes("x-idem-seq");
    h[n].value.kind = AMQP_FIELD_KIND_I64;
    h[n++].value.value.i64 = e->seq;
    /* the shard key: a partitioned group's QUEUE.part routes it to one partition, whatever the
     * broker's state; RabbitMQ removes BCC before delivery */
    char shard_key[24];
    amqp_field_value_t shard_val;
    int shard = idemp_amqp_shard(e->subscription_id);
    if (shard >= 0) {
        snprintf(shard_key, sizeof shard_key, "idem.shard.%d", shard);
        shard_val.kind = AMQP_FIELD_KIND_UTF8;
        shard_val.value.bytes = amqp_cstring_bytes(shard_key);
        h[n].key = amqp_cstring_bytes("BCC");
        h[n].value.kind = AMQP_FIELD_KIND_ARRAY;
        h[n].value.value.array = (amqp_array_t){1, &shard_val};
        n++;
    }
    int rc = IDEM_OK;
    const char *k;
    json_t *v;
    json_object_foreach(extra, k, v)
    {
        size_t klen = strlen(k);
        if (!json_is_string(v)) {
            rc = idem_error_set(err, IDEM_ERR_UNENCODABLE, "header '%.100s' is not a string", k);
            break;
        }
        if (klen == 0 || klen > 255) {
            rc = idem_error_set(err, IDEM_ERR_UNENCODABLE, "a header name is %zu bytes (1-255)",
                                klen);
            break;
        }
        if (strcmp(k, "CC") == 0 || strcmp(k, "BCC") == 0) {
            /* RabbitMQ routes copies by these and refuses any that is not an array of strings */
            rc = idem_error_set(err, IDEM_ERR_UNENCODABLE,
                                "header '%s' is RabbitMQ's sender-selected routing (an array, not "
                                "a string)",
                                k);
            break;
        }
        if (strcmp(k, "event_id") == 0 || strcmp(k, "subscription_id") == 0 ||
            strcmp(k, "event_type") == 0 || strncmp(k, "x-idem-", 7) == 0)
            continue; /* ours win */
        h[n].key = amqp_cstring_bytes(k);
        h[n].value.kind = AMQP_FIELD_KIND_UTF8;
        h[n].value.value.bytes.bytes = (void *)json_string_value(v);
        h[n].value.value.bytes.len = json_string_length(v);
        n++;
    }
    amqp_basic_properties_t props;
    memset(&props, 0, sizeof props);
    props._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
                   AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TYPE_FLAG | AMQP_BASIC_TIMESTAMP_FLAG |
                   AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_USER_ID_FLAG;
    props.user_id = login_user(a);
    props.content_type = amqp_cstring_bytes("application/json");
    props.delivery_mode = 2;
    props.message_id = amqp_cstring_bytes(e->event_id);
    props.type = amqp_cstring_bytes(e->event_type);
    props.timestamp = e->timestamp_s < 0 ? 0 : (uint64_t)e->timestamp_s;
    props.headers = (amqp_table_t){n, h};
    if (rc == IDEM_OK && encoded_size(a, &props) < 0)
        rc = idem_error_set(err, IDEM_ERR_UNENCODABLE,
                            "the message properties and headers do not fit one AMQP frame");
    if (rc == IDEM_OK) {
        amqp_bytes_t body = {e->body_len, (void *)e->body};
        int st = amqp_basic_publish(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(exchange),
                                    amqp_cstring_bytes(e->event_type), 1, 0, &props, body);
        if (st != AMQP_STATUS_OK)
            rc = idemp_amqp_lost(a, st, "basic.publish", err);
        else
            idemp_amqp_published(a, tag);
    }
    if (h != fixed)
        free(h);
    json_decref(extra);
    return rc;
}

int idemp_amqp_requeue(idemp_amqp_t *out, const idemp_msg_t *m, const char *exchange,
                       const char *routing_key, int64_t timeout_ms, idem_error_t *err)
{
    if (!out->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s",
                              out->where);
    amqp_basic_properties_t p = m->props;
    int old = (p._flags & AMQP_BASIC_HEADERS_FLAG) ? p.headers.num_entries : 0;
    amqp_table_entry_t *entries = calloc((size_t)old + 1, sizeof *entries);
    if (entries == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    int64_t moves = 0;
    int n = 0;
    for (int i = 0; i < old; i++) {
        amqp_table_entry_t *e = &m->props.headers.entries[i];
        if (key_is(e, "x-idem-requeued")) {
            if (e->value.kind == AMQP_FIELD_KIND_I64)
                moves = e->value.value.i64;
            else if (e->value.kind == AMQP_FIELD_KIND_I32)
                moves = e->value.value.i32;
            continue;
        }
        if (key_is(e, "x-idem-error") || key_is(e, "x-idem-dropped-headers"))
            continue;
        entries[n++] = *e;
    }
    entries[n].key = amqp_cstring_bytes("x-idem-requeued");
    entries[n].value.kind = AMQP_FIELD_KIND_I64;
    entries[n].value.value.i64 = moves < 0 ? 1 : moves < INT64_MAX ? moves + 1 : INT64_MAX;
    n++;
    p.headers.entries = entries;
    p.headers.num_entries = n;
    /* the requeuer vouches for what it moves: a consumer trusting its user accepts it */
    p._flags |= AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_USER_ID_FLAG;
    p.delivery_mode = 2;
    p.user_id = login_user(out);
    int st = amqp_basic_publish(out->conn, IDEMP_CHANNEL, amqp_cstring_bytes(exchange),
                                amqp_cstring_bytes(routing_key), 1, 0, &p, m->body);
    free(entries);
    if (st != AMQP_STATUS_OK)
        return idemp_amqp_lost(out, st, "basic.publish", err);
    uint64_t tag;
    idemp_amqp_published(out, &tag);
    return idemp_amqp_confirm_one(out, tag, timeout_ms, err);
}
