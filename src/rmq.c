/* rmq.c - the RabbitMQ adapter over librabbitmq 0.11. */
#include <ctype.h>
#include <errno.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include <amqp.h>
#include <amqp_framing.h>
#include <amqp_tcp_socket.h>

#include "rmq.h"
#include "clock.h"

#define CHANNEL 1

struct idemp_amqp {
    idemp_amqp_url_t url;
    char where[300];
    amqp_connection_state_t conn;
    bool connected;
    bool confirms;
    uint64_t next_tag;  /* next publish sequence number in confirm mode */
    uint64_t confirmed; /* all tags <= confirmed are settled */
    uint8_t *settled;   /* settled[i]: tag confirmed + 1 + i settled out of order */
    size_t settled_cap;
};

static int unhex(int ch)
{
    if (isdigit(ch))
        return ch - '0';
    ch = tolower(ch);
    return (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10 : -1;
}

/* Copies [s, s+n) percent-decoded into out; false when it does not fit or is malformed. */
static bool decode(const char *s, size_t n, char *out, size_t outsz)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int ch = (unsigned char)s[i];
        if (ch == '%') {
            if (i + 2 >= n)
                return false;
            int hi = unhex((unsigned char)s[i + 1]);
            int lo = unhex((unsigned char)s[i + 2]);
            if (hi < 0 || lo < 0)
                return false;
            ch = hi * 16 + lo;
            i += 2;
        }
        if (o + 1 >= outsz)
            return false;
        out[o++] = (char)ch;
    }
    out[o] = '\0';
    return true;
}

int idemp_amqp_url_parse(const char *url, idemp_amqp_url_t *u)
{
    memset(u, 0, sizeof *u);
    if (url == NULL || strncmp(url, "amqp://", 7) != 0)
        return IDEM_ERR_INVALID;
    const char *p = url + 7;
    const char *end = p + strcspn(p, "/?#");
    const char *at = NULL;
    for (const char *q = p; q < end; q++)
        if (*q == '@')
            at = q;
    strcpy(u->user, "guest");
    strcpy(u->password, "guest");
    if (at != NULL) {
        const char *colon = memchr(p, ':', at - p);
        if (colon != NULL) {
            if (!decode(p, colon - p, u->user, sizeof u->user) ||
                !decode(colon + 1, at - colon - 1, u->password, sizeof u->password))
                return IDEM_ERR_INVALID;
        } else if (!decode(p, at - p, u->user, sizeof u->user)) {
            return IDEM_ERR_INVALID;
        }
        p = at + 1;
    }
    const char *colon = NULL;
    if (*p == '[') { /* [ipv6]:port */
        const char *rb = memchr(p, ']', end - p);
        if (rb == NULL)
            return IDEM_ERR_INVALID;
        if ((size_t)(rb - p - 1) >= sizeof u->host)
            return IDEM_ERR_INVALID;
        memcpy(u->host, p + 1, rb - p - 1);
        colon = rb + 1 < end && rb[1] == ':' ? rb + 1 : NULL;
        if (rb + 1 < end && colon == NULL)
            return IDEM_ERR_INVALID;
    } else {
        colon = memchr(p, ':', end - p);
        const char *hend = colon ? colon : end;
        if ((size_t)(hend - p) >= sizeof u->host)
            return IDEM_ERR_INVALID;
        memcpy(u->host, p, hend - p);
    }
    if (u->host[0] == '\0')
        strcpy(u->host, "localhost");
    u->port = 5672;
    if (colon != NULL) {
        long port = 0;
        if (colon + 1 == end)
            return IDEM_ERR_INVALID;
        for (const char *q = colon + 1; q < end; q++) {
            if (!isdigit((unsigned char)*q))
                return IDEM_ERR_INVALID;
            port = port * 10 + (*q - '0');
            if (port > 65535)
                return IDEM_ERR_INVALID;
        }
        if (port == 0)
            return IDEM_ERR_INVALID;
        u->port = (int)port;
    }
    const char *path = end;
    if (*path == '/')
        path++;
    size_t plen = strcspn(path, "?#");
    if (plen == 0) {
        strcpy(u->vhost, "/");
    } else if (!decode(path, plen, u->vhost, sizeof u->vhost)) {
        return IDEM_ERR_INVALID;
    }
    return IDEM_OK;
}

idemp_amqp_t *idemp_amqp_new(const char *url, idem_error_t *err)
{
    idemp_amqp_t *a = calloc(1, sizeof *a);
    if (a == NULL) {
        idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (idemp_amqp_url_parse(url, &a->url) != IDEM_OK) {
        /* the URL may hold a password: the error text is masked by idem_error_set */
        idem_error_set(err, IDEM_ERR_INVALID, "invalid AMQP URL: %s", url ? url : "(null)");
        free(a);
        return NULL;
    }
    snprintf(a->where, sizeof a->where, "%s:%d", a->url.host, a->url.port);
    return a;
}

void idemp_amqp_disconnect(idemp_amqp_t *a)
{
    if (a->conn != NULL) {
        if (a->connected) {
            amqp_channel_close(a->conn, CHANNEL, AMQP_REPLY_SUCCESS);
            amqp_connection_close(a->conn, AMQP_REPLY_SUCCESS);
        }
        amqp_destroy_connection(a->conn);
    }
    a->conn = NULL;
    a->connected = false;
}

void idemp_amqp_free(idemp_amqp_t *a)
{
    if (a == NULL)
        return;
    idemp_amqp_disconnect(a);
    free(a->settled);
    free(a);
}

bool idemp_amqp_connected(const idemp_amqp_t *a)
{
    return a->connected;
}

const char *idemp_amqp_where(const idemp_amqp_t *a)
{
    return a->where;
}

/* Text for a failed RPC reply; *lost tells a dead socket from a broker refusal. */
static void reply_text(amqp_rpc_reply_t r, char *out, size_t sz, bool *lost)
{
    *lost = false;
    switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL:
        snprintf(out, sz, "ok");
        break;
    case AMQP_RESPONSE_NONE:
        snprintf(out, sz, "missing RPC reply");
        *lost = true;
        break;
    case AMQP_RESPONSE_LIBRARY_EXCEPTION:
        snprintf(out, sz, "%s", amqp_error_string2(r.library_error));
        *lost = true;
        break;
    case AMQP_RESPONSE_SERVER_EXCEPTION:
        if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
            amqp_connection_close_t *m = r.reply.decoded;
            snprintf(out, sz, "connection closed by broker: %u %.*s", m->reply_code,
                     (int)m->reply_text.len, (const char *)m->reply_text.bytes);
        } else if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
            amqp_channel_close_t *m = r.reply.decoded;
            snprintf(out, sz, "channel closed by broker: %u %.*s", m->reply_code,
                     (int)m->reply_text.len, (const char *)m->reply_text.bytes);
        } else {
            snprintf(out, sz, "unexpected server method 0x%08X", r.reply.id);
        }
        break;
    }
}

/* Checks the last RPC reply; on failure the connection is marked unusable. */
static int check_rpc(idemp_amqp_t *a, amqp_rpc_reply_t r, const char *what, idem_error_t *err)
{
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return IDEM_OK;
    char text[300];
    bool lost;
    reply_text(r, text, sizeof text, &lost);
    a->connected = false; /* a closed channel needs a fresh connection in this design */
    return idem_error_set(err, lost ? IDEM_ERR_AMQP_LOST : IDEM_ERR_AMQP, "%s: %s", what, text);
}

/* librabbitmq's non-blocking connect reports only "a socket error occurred"; after a failure a
 * plain connect tells the operator why (refused, unreachable, unknown host). */
static void tcp_reason(const char *host, int port, int amqp_rc, char *out, size_t sz)
{
    snprintf(out, sz, "%s", amqp_error_string2(amqp_rc));
    if (amqp_rc != AMQP_STATUS_SOCKET_ERROR && amqp_rc != AMQP_STATUS_HOSTNAME_RESOLUTION_FAILED)
        return;
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    int g = getaddrinfo(host, portstr, &hints, &ai);
    if (g != 0) {
        snprintf(out, sz, "cannot resolve host: %s", gai_strerror(g));
        return;
    }
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd >= 0) {
        struct timeval tv = {2, 0};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0)
            snprintf(out, sz, "%s", strerror(errno));
        close(fd);
    }
    freeaddrinfo(ai);
}

int idemp_amqp_connect(idemp_amqp_t *a, bool confirms, idem_error_t *err)
{
    idemp_amqp_disconnect(a);
    a->conn = amqp_new_connection();
    if (a->conn == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    amqp_socket_t *sock = amqp_tcp_socket_new(a->conn);
    if (sock == NULL) {
        idemp_amqp_disconnect(a);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    struct timeval tv = {10, 0};
    amqp_set_handshake_timeout(a->conn, &tv);
    amqp_set_rpc_timeout(a->conn, &tv);
    int rc = amqp_socket_open_noblock(sock, a->url.host, a->url.port, &tv);
    if (rc != AMQP_STATUS_OK) {
        char why[200];
        tcp_reason(a->url.host, a->url.port, rc, why, sizeof why);
        idemp_amqp_disconnect(a);
        return idem_error_set(err, IDEM_ERR_AMQP_CONNECT, "cannot connect to RabbitMQ at %s: %s",
                              a->where, why);
    }
    amqp_rpc_reply_t r = amqp_login(a->conn, a->url.vhost, 0, 131072, 0, AMQP_SASL_METHOD_PLAIN,
                                    a->url.user, a->url.password);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        char text[300];
        bool lost;
        reply_text(r, text, sizeof text, &lost);
        if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
            r.library_error == AMQP_STATUS_CONNECTION_CLOSED)
            snprintf(text, sizeof text, "login refused (ACCESS_REFUSED) for user '%s'",
                     a->url.user);
        idemp_amqp_disconnect(a);
        return idem_error_set(err, IDEM_ERR_AMQP_CONNECT, "cannot connect to RabbitMQ at %s: %s",
                              a->where, text);
    }
    a->connected = true;
    amqp_channel_open(a->conn, CHANNEL);
    rc = check_rpc(a, amqp_get_rpc_reply(a->conn), "channel.open", err);
    if (rc == IDEM_OK && confirms) {
        amqp_confirm_select(a->conn, CHANNEL);
        rc = check_rpc(a, amqp_get_rpc_reply(a->conn), "confirm.select", err);
    }
    if (rc != IDEM_OK) {
        idemp_amqp_disconnect(a);
        return rc;
    }
    a->confirms = confirms;
    a->next_tag = 1;
    a->confirmed = 0;
    if (a->settled != NULL)
        memset(a->settled, 0, a->settled_cap);
    return IDEM_OK;
}

int idemp_amqp_declare_exchange(idemp_amqp_t *a, const char *name, idem_error_t *err)
{
    amqp_exchange_declare(a->conn, CHANNEL, amqp_cstring_bytes(name), amqp_cstring_bytes("topic"),
                          0, 1, 0, 0, amqp_empty_table);
    return check_rpc(a, amqp_get_rpc_reply(a->conn), "exchange.declare", err);
}

int idemp_amqp_declare_queue(idemp_amqp_t *a, const char *name, bool quorum, const char *dlq,
                             idem_error_t *err)
{
    amqp_table_entry_t e[3];
    int n = 0;
    if (quorum) {
        e[n].key = amqp_cstring_bytes("x-queue-type");
        e[n].value.kind = AMQP_FIELD_KIND_UTF8;
        e[n].value.value.bytes = amqp_cstring_bytes("quorum");
        n++;
    }
    if (dlq != NULL) {
        e[n].key = amqp_cstring_bytes("x-dead-letter-exchange");
        e[n].value.kind = AMQP_FIELD_KIND_UTF8;
        e[n].value.value.bytes = amqp_cstring_bytes("");
        n++;
        e[n].key = amqp_cstring_bytes("x-dead-letter-routing-key");
        e[n].value.kind = AMQP_FIELD_KIND_UTF8;
        e[n].value.value.bytes = amqp_cstring_bytes(dlq);
        n++;
    }
    amqp_table_t args = {n, e};
    amqp_queue_declare(a->conn, CHANNEL, amqp_cstring_bytes(name), 0, 1, 0, 0, args);
    return check_rpc(a, amqp_get_rpc_reply(a->conn), "queue.declare", err);
}

int idemp_amqp_bind(idemp_amqp_t *a, const char *queue, const char *exchange, const char *key,
                    idem_error_t *err)
{
    amqp_queue_bind(a->conn, CHANNEL, amqp_cstring_bytes(queue), amqp_cstring_bytes(exchange),
                    amqp_cstring_bytes(key), amqp_empty_table);
    return check_rpc(a, amqp_get_rpc_reply(a->conn), "queue.bind", err);
}

int idemp_amqp_consume(idemp_amqp_t *a, const char *queue, int prefetch, idem_error_t *err)
{
    amqp_basic_qos(a->conn, CHANNEL, 0, (uint16_t)prefetch, 0);
    int rc = check_rpc(a, amqp_get_rpc_reply(a->conn), "basic.qos", err);
    if (rc != IDEM_OK)
        return rc;
    amqp_basic_consume(a->conn, CHANNEL, amqp_cstring_bytes(queue), amqp_empty_bytes, 0, 0, 0,
                       amqp_empty_table);
    return check_rpc(a, amqp_get_rpc_reply(a->conn), "basic.consume", err);
}

int idemp_amqp_publish(idemp_amqp_t *a, const char *exchange, const char *routing_key,
                       bool mandatory, const amqp_basic_properties_t *props, const void *body,
                       size_t len, uint64_t *tag, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_bytes_t b = {len, (void *)body};
    int rc = amqp_basic_publish(a->conn, CHANNEL, amqp_cstring_bytes(exchange),
                                amqp_cstring_bytes(routing_key), mandatory, 0, props, b);
    if (rc != AMQP_STATUS_OK) {
        a->connected = false;
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "basic.publish to %s: %s", a->where,
                              amqp_error_string2(rc));
    }
    if (tag != NULL)
        *tag = a->next_tag;
    a->next_tag++;
    return IDEM_OK;
}

/* Handles a connection.close or channel.close frame: reply close-ok, mark unusable. */
static int on_close_frame(idemp_amqp_t *a, amqp_frame_t *f, idem_error_t *err)
{
    amqp_rpc_reply_t r = {AMQP_RESPONSE_SERVER_EXCEPTION, f->payload.method, 0};
    char text[300];
    bool lost;
    reply_text(r, text, sizeof text, &lost);
    if (f->payload.method.id == AMQP_CONNECTION_CLOSE_METHOD) {
        amqp_connection_close_ok_t ok;
        amqp_send_method(a->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
    } else {
        amqp_channel_close_ok_t ok;
        amqp_send_method(a->conn, f->channel, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
    }
    a->connected = false;
    return idem_error_set(err, IDEM_ERR_AMQP, "%s", text);
}

static int wait_frame(idemp_amqp_t *a, amqp_frame_t *f, int64_t timeout_ms, idem_error_t *err)
{
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    int rc = amqp_simple_wait_frame_noblock(a->conn, f, &tv);
    if (rc == AMQP_STATUS_TIMEOUT)
        return IDEM_ERR_TIMEOUT;
    if (rc != AMQP_STATUS_OK) {
        a->connected = false;
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "connection to RabbitMQ at %s lost: %s",
                              a->where, amqp_error_string2(rc));
    }
    return IDEM_OK;
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

int idemp_amqp_wait_confirms(idemp_amqp_t *a, uint64_t last_tag, int64_t timeout_ms,
                             idemp_confirm_fn fn, void *ud, idem_error_t *err)
{
    int64_t deadline = idemp_now_ms() + timeout_ms;
    while (a->confirmed < last_tag) {
        if (!a->connected)
            return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s",
                                  a->where);
        int64_t left = deadline - idemp_now_ms();
        if (left <= 0)
            return idem_error_set(err, IDEM_ERR_TIMEOUT,
                                  "no publisher confirm from RabbitMQ at %s within %lld ms",
                                  a->where, (long long)timeout_ms);
        amqp_frame_t f;
        int rc = wait_frame(a, &f, left, err);
        if (rc == IDEM_ERR_TIMEOUT)
            continue;
        if (rc != IDEM_OK)
            return rc;
        if (f.frame_type != AMQP_FRAME_METHOD)
            continue;
        switch (f.payload.method.id) {
        case AMQP_BASIC_ACK_METHOD: {
            amqp_basic_ack_t *m = f.payload.method.decoded;
            fn(ud, IDEMP_CONFIRM_ACK, m->delivery_tag, m->multiple, NULL);
            settle(a, m->delivery_tag, m->multiple);
            break;
        }
        case AMQP_BASIC_NACK_METHOD: {
            amqp_basic_nack_t *m = f.payload.method.decoded;
            fn(ud, IDEMP_CONFIRM_NACK, m->delivery_tag, m->multiple, NULL);
            settle(a, m->delivery_tag, m->multiple);
            break;
        }
        case AMQP_BASIC_RETURN_METHOD: {
            amqp_message_t msg;
            amqp_rpc_reply_t r = amqp_read_message(a->conn, f.channel, &msg, 0);
            if (r.reply_type != AMQP_RESPONSE_NORMAL)
                return check_rpc(a, r, "basic.return", err);
            fn(ud, IDEMP_CONFIRM_RETURN, 0, false, &msg);
            amqp_destroy_message(&msg);
            break;
        }
        case AMQP_CHANNEL_CLOSE_METHOD:
        case AMQP_CONNECTION_CLOSE_METHOD:
            return on_close_frame(a, &f, err);
        default:
            break;
        }
    }
    amqp_maybe_release_buffers(a->conn);
    return IDEM_OK;
}

int idemp_amqp_next(idemp_amqp_t *a, amqp_envelope_t *env, int64_t timeout_ms, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_maybe_release_buffers(a->conn);
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    amqp_rpc_reply_t r = amqp_consume_message(a->conn, env, &tv, 0);
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return IDEM_OK;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_TIMEOUT)
        return IDEM_ERR_TIMEOUT;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
        r.library_error == AMQP_STATUS_UNEXPECTED_STATE) {
        /* a frame other than a delivery: a close, a cancel, or a stray confirm */
        amqp_frame_t f;
        int rc = wait_frame(a, &f, 0, err);
        if (rc == IDEM_ERR_TIMEOUT)
            return IDEM_ERR_TIMEOUT;
        if (rc != IDEM_OK)
            return rc;
        if (f.frame_type == AMQP_FRAME_METHOD) {
            switch (f.payload.method.id) {
            case AMQP_CHANNEL_CLOSE_METHOD:
            case AMQP_CONNECTION_CLOSE_METHOD:
                return on_close_frame(a, &f, err);
            case AMQP_BASIC_CANCEL_METHOD:
                a->connected = false;
                return idem_error_set(err, IDEM_ERR_AMQP,
                                      "broker cancelled the consumer (queue deleted?)");
            default:
                break;
            }
        }
        return IDEM_ERR_TIMEOUT;
    }
    return check_rpc(a, r, "basic.consume", err);
}

bool idemp_amqp_buffered(idemp_amqp_t *a)
{
    return a->conn != NULL && (amqp_data_in_buffer(a->conn) || amqp_frames_enqueued(a->conn));
}

int idemp_amqp_ack(idemp_amqp_t *a, uint64_t tag, bool multiple, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    int rc = amqp_basic_ack(a->conn, CHANNEL, tag, multiple);
    if (rc != AMQP_STATUS_OK) {
        a->connected = false;
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "basic.ack to %s: %s", a->where,
                              amqp_error_string2(rc));
    }
    return IDEM_OK;
}
