/* rmq.c - the RabbitMQ adapter over librabbitmq 0.11: connections (TCP or TLS, see
 * rmq_socket.c) with heartbeats and backoff, a node list, frames and acks. URLs are in
 * rmq_url.c, topology in rmq_topology.c, confirms in rmq_confirm.c, deliveries in
 * rmq_deliver.c, publishes and dead-letter copies in rmq_publish.c. */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <amqp_tcp_socket.h>

#include <idem/log.h>

#include "clock.h"
#include "host.h"
#include "mask.h"
#include "rmq_int.h"

#define CONNECT_TIMEOUT_S 10
#define STABLE_MS 10000 /* a connection up this long resets the backoff when it drops */
#define DEFAULT_HEARTBEAT_S 30

/* ---- the connection object ---------------------------------------------------------------- */

/* librabbitmq decodes a content header's tables and arrays recursively (about 100 bytes of stack
 * a level) before idem sees the message: a 128 KiB frame can nest 26,000 levels. The main
 * thread's stack grows up to RLIMIT_STACK, so a small soft limit is raised to 8 MiB where the
 * hard limit allows; below 4 MiB a deep header could crash the process, which is said once. */
#define STACK_WANT (8L << 20)
#define STACK_NEED (4L << 20)

static void reserve_stack(const char *component)
{
    static bool done;
    if (done)
        return;
    done = true;
    struct rlimit r;
    if (getrlimit(RLIMIT_STACK, &r) != 0 || r.rlim_cur == RLIM_INFINITY ||
        r.rlim_cur >= (rlim_t)STACK_WANT)
        return;
    rlim_t want = r.rlim_max == RLIM_INFINITY || r.rlim_max > (rlim_t)STACK_WANT
                      ? (rlim_t)STACK_WANT
                      : r.rlim_max;
    if (want > r.rlim_cur) {
        r.rlim_cur = want;
        if (setrlimit(RLIMIT_STACK, &r) != 0)
            getrlimit(RLIMIT_STACK, &r);
    }
    if (r.rlim_cur < (rlim_t)STACK_NEED)
        idem_log(IDEM_LOG_WARN, component, NULL,
                 "stack limit is %lu KiB (hard limit): a message whose headers nest deeper than "
                 "about %lu levels would crash the process; allow 8 MiB (ulimit -s 8192)",
                 (unsigned long)(r.rlim_cur >> 10), (unsigned long)(r.rlim_cur / 160));
}

static void set_where(idemp_amqp_t *a)
{
    const idemp_amqp_url_t *u = &a->urls[a->cur];
    snprintf(a->where, sizeof a->where, "%s:%d", u->host, u->port);
}

idemp_amqp_t *idemp_amqp_new(const char *urls, const char *component, int heartbeat_s,
                             idem_error_t *err)
{
    idemp_amqp_t *a = calloc(1, sizeof *a);
    char *copy = strdup(urls ? urls : "");
    if (a == NULL || copy == NULL) {
        free(a);
        free(copy);
        idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        return NULL;
    }
    a->component = component ? component : "rabbitmq";
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        if (*tok == '\0')
            continue;
        if (a->nurls == IDEMP_AMQP_URLS_MAX ||
            idemp_amqp_url_parse(tok, &a->urls[a->nurls]) != IDEM_OK) {
            /* the whole list, not the piece (a ',' in a password cuts a URL in two), with
             * everything before its last '@' hidden: a URL that does not parse cannot be trusted
             * to show where its password ends (say one holding "://") */
            char shown[512];
            idemp_mask_unparsed_url(urls, shown, sizeof shown);
            idem_error_set(err, IDEM_ERR_INVALID, "invalid AMQP URL: %s", shown);
            free(copy);
            free(a);
            return NULL;
        }
        a->nurls++;
    }
    free(copy);
    if (a->nurls == 0) {
        idem_error_set(err, IDEM_ERR_INVALID, "invalid AMQP URL: empty");
        free(a);
        return NULL;
    }
    if (heartbeat_s < 0)
        heartbeat_s = a->urls[0].heartbeat_s >= 0 ? a->urls[0].heartbeat_s : DEFAULT_HEARTBEAT_S;
    a->heartbeat_s = heartbeat_s > 65535 ? 65535 : heartbeat_s;
    idemp_backoff_init(&a->backoff, 250, 5000);
    set_where(a);
    reserve_stack(a->component);
    return a;
}

int idemp_amqp_set_password(idemp_amqp_t *a, const char *password)
{
    if (password == NULL || strlen(password) >= sizeof a->urls[0].password)
        return IDEM_ERR_INVALID;
    for (int i = 0; i < a->nurls; i++)
        snprintf(a->urls[i].password, sizeof a->urls[i].password, "%s", password);
    return IDEM_OK;
}

const char *idemp_amqp_reload_password(idemp_amqp_t *const *a, int n,
                                       int (*fn)(void *, char *, size_t, idem_error_t *), void *ud,
                                       const char *component)
{
    if (fn == NULL)
        return "not configured";
    char pw[sizeof a[0]->urls[0].password + 2];
    idem_error_t e = {0};
    int rc = fn(ud, pw, sizeof pw, &e);
    bool fits = rc > 0 && strlen(pw) < sizeof a[0]->urls[0].password;
    for (int i = 0; fits && i < n; i++)
        idemp_amqp_set_password(a[i], pw);
    memset(pw, 0, sizeof pw);
    if (rc == 0)
        return "not configured";
    if (fits)
        return "re-read";
    idem_log(IDEM_LOG_WARN, component, NULL,
             "the AMQP password file was not re-read; the password in use stays: %s",
             rc < 0 ? e.text : "the password is too long");
    return "kept";
}

static void close_conn(idemp_amqp_t *a)
{
    if (a->conn != NULL) {
        if (a->connected) {
            amqp_channel_close(a->conn, IDEMP_CHANNEL, AMQP_REPLY_SUCCESS);
            amqp_connection_close(a->conn, AMQP_REPLY_SUCCESS);
        }
        amqp_destroy_connection(a->conn);
    }
    a->conn = NULL;
    a->connected = false;
    a->corked = false;
    a->body_left = 0;
}

void idemp_amqp_disconnect(idemp_amqp_t *a, const char *reason)
{
    if (a->conn != NULL && reason != NULL) {
        const char *kv[] = {"server", a->where, NULL};
        idem_log(IDEM_LOG_WARN, a->component, kv, "RabbitMQ connection dropped: %s", reason);
        /* something went wrong: do not wait for close handshakes on a link that may be dead */
        a->connected = false;
    }
    bool was_connected = a->conn != NULL;
    close_conn(a);
    int64_t now = idemp_now_ms();
    if (was_connected && now - a->connected_at >= STABLE_MS) {
        idemp_backoff_reset(&a->backoff); /* it had been up a while: try again at once */
        a->next_ms = now;
    } else if (was_connected) {
        /* it went down soon after coming up (a refused declare, a node still electing): keep
         * backing off instead of reconnecting in a loop */
        int64_t wait = idemp_backoff_next(&a->backoff);
        a->next_ms = now + (wait < a->backoff.base_ms ? a->backoff.base_ms : wait);
    }
}

void idemp_amqp_free(idemp_amqp_t *a)
{
    if (a == NULL)
        return;
    close_conn(a);
    free(a->settled);
    free(a->scratch);
    /* the URLs hold passwords */
    memset(a->urls, 0, sizeof a->urls);
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

bool idemp_amqp_tls(const idemp_amqp_t *a)
{
    return a->urls[a->cur].tls;
}

int idemp_amqp_socket(const idemp_amqp_t *a)
{
    return a->connected ? amqp_get_sockfd(a->conn) : -1;
}

int idemp_amqp_close_code(const idemp_amqp_t *a)
{
    return a->close_code;
}

bool idemp_amqp_buffered(const idemp_amqp_t *a)
{
    return a->conn != NULL && (amqp_data_in_buffer(a->conn) || amqp_frames_enqueued(a->conn));
}

/* Text for a failed RPC reply; *lost tells a dead socket from a broker refusal. */
static void reply_text(amqp_rpc_reply_t r, char *out, size_t sz, bool *lost, int *code)
{
    *lost = false;
    *code = 0;
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
            *code = m->reply_code;
            snprintf(out, sz, "connection closed by broker: %u %.*s", m->reply_code,
                     (int)m->reply_text.len, (const char *)m->reply_text.bytes);
        } else if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
            amqp_channel_close_t *m = r.reply.decoded;
            *code = m->reply_code;
            snprintf(out, sz, "channel closed by broker: %u %.*s", m->reply_code,
                     (int)m->reply_text.len, (const char *)m->reply_text.bytes);
        } else {
            snprintf(out, sz, "unexpected server method 0x%08X", r.reply.id);
        }
        break;
    }
}

static void send_close_ok(idemp_amqp_t *a, amqp_method_number_t id, amqp_channel_t ch)
{
    if (id == AMQP_CONNECTION_CLOSE_METHOD) {
        amqp_connection_close_ok_t ok;
        amqp_send_method(a->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD, &ok);
    } else if (id == AMQP_CHANNEL_CLOSE_METHOD) {
        amqp_channel_close_ok_t ok;
        amqp_send_method(a->conn, ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
    }
}

int idemp_amqp_check_rpc(idemp_amqp_t *a, amqp_rpc_reply_t r, const char *what, idem_error_t *err)
{
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return IDEM_OK;
    char text[300];
    bool lost;
    reply_text(r, text, sizeof text, &lost, &a->close_code);
    if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION)
        send_close_ok(a, r.reply.id, IDEMP_CHANNEL);
    a->connected = false; /* a closed channel needs a fresh connection in this design */
    return idem_error_set(err, lost ? IDEM_ERR_AMQP_LOST : IDEM_ERR_AMQP, "%s: %s", what, text);
}

int idemp_amqp_lost(idemp_amqp_t *a, int amqp_status, const char *what, idem_error_t *err)
{
    a->connected = false;
    return idem_error_set(err, IDEM_ERR_AMQP_LOST, "%s: connection to RabbitMQ at %s lost: %s",
                          what, a->where, amqp_error_string2(amqp_status));
}

int idemp_amqp_on_close(idemp_amqp_t *a, const amqp_frame_t *f, idem_error_t *err)
{
    amqp_rpc_reply_t r = {AMQP_RESPONSE_SERVER_EXCEPTION, f->payload.method, 0};
    char text[300];
    bool lost;
    reply_text(r, text, sizeof text, &lost, &a->close_code);
    send_close_ok(a, f->payload.method.id, f->channel);
    a->connected = false;
    return idem_error_set(err, IDEM_ERR_AMQP, "%s", text);
}

void idemp_amqp_cork(idemp_amqp_t *a)
{
    if (a->corked || !a->connected)
        return;
    int one = 1;
    a->corked = setsockopt(amqp_get_sockfd(a->conn), IPPROTO_TCP, TCP_CORK, &one, sizeof one) == 0;
}

void idemp_amqp_flush(idemp_amqp_t *a)
{
    if (!a->corked)
        return;
    a->corked = false;
    int zero = 0;
    if (a->conn != NULL)
        setsockopt(amqp_get_sockfd(a->conn), IPPROTO_TCP, TCP_CORK, &zero, sizeof zero);
}

int idemp_amqp_wait_frame(idemp_amqp_t *a, amqp_frame_t *f, int64_t timeout_ms, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    if (timeout_ms > 0)
        idemp_amqp_flush(a); /* what we sent must be out before we wait for an answer */
    if (timeout_ms < 0)
        timeout_ms = 0;
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    int rc = amqp_simple_wait_frame_noblock(a->conn, f, &tv);
    if (rc == AMQP_STATUS_TIMEOUT)
        return IDEM_ERR_TIMEOUT;
    if (rc != AMQP_STATUS_OK)
        return idemp_amqp_lost(a, rc, "read", err);
    return IDEM_OK;
}

static int connect_url(idemp_amqp_t *a, bool confirms, idem_error_t *err)
{
    const idemp_amqp_url_t *u = &a->urls[a->cur];
    set_where(a);
    close_conn(a);
    a->close_code = 0;
    a->conn = amqp_new_connection();
    if (a->conn == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    char why[300] = "";
    amqp_socket_t *sock =
        u->tls ? idemp_amqp_tls_socket(a->conn, u, why, sizeof why) : amqp_tcp_socket_new(a->conn);
    if (sock == NULL) {
        close_conn(a);
        return idem_error_set(err, IDEM_ERR_AMQP_CONNECT,
                              "cannot connect to RabbitMQ at %s: %s (tls=%s)", a->where,
                              why[0] ? why : "out of memory", u->tls ? "on" : "off");
    }
    struct timeval tv = {CONNECT_TIMEOUT_S, 0};
    amqp_set_handshake_timeout(a->conn, &tv);
    amqp_set_rpc_timeout(a->conn, &tv);
    int rc = amqp_socket_open_noblock(sock, u->host, u->port, &tv);
    if (rc != AMQP_STATUS_OK) {
        idemp_amqp_tcp_reason(u->host, u->port, rc, why, sizeof why);
        if (rc != AMQP_STATUS_SSL_HOSTNAME_VERIFY_FAILED)
            idemp_amqp_tls_detail(u, false, why, sizeof why);
        close_conn(a);
        return idem_error_set(err, IDEM_ERR_AMQP_CONNECT,
                              "cannot connect to RabbitMQ at %s: %s (tls=%s)", a->where, why,
                              u->tls ? "on" : "off");
    }
    int fd = amqp_get_sockfd(a->conn);
    int one = 1, idle = 30, intvl = 10, cnt = 3;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    amqp_rpc_reply_t r = amqp_login(a->conn, u->vhost, 0, IDEMP_FRAME_MAX, a->heartbeat_s,
                                    AMQP_SASL_METHOD_PLAIN, u->user, u->password);
    if (r.reply_type != AMQP_RESPONSE_NORMAL) {
        char text[300];
        bool lost;
        int code;
        reply_text(r, text, sizeof text, &lost, &code);
        if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
            r.library_error == AMQP_STATUS_CONNECTION_CLOSED)
            snprintf(text, sizeof text, "login refused (ACCESS_REFUSED) for user '%s'", u->user);
        else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION)
            idemp_amqp_tls_detail(u, true, text, sizeof text);
        close_conn(a);
        return idem_error_set(err, IDEM_ERR_AMQP_CONNECT,
                              "cannot connect to RabbitMQ at %s: %s (tls=%s)", a->where, text,
                              u->tls ? "on" : "off");
    }
    a->connected = true;
    amqp_channel_open(a->conn, IDEMP_CHANNEL);
    rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "channel.open", err);
    if (rc == IDEM_OK && confirms) {
        amqp_confirm_select(a->conn, IDEMP_CHANNEL);
        rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "confirm.select", err);
    }
    if (rc != IDEM_OK) {
        close_conn(a);
        return rc;
    }
    a->confirms = confirms;
    a->next_tag = 1;
    a->confirmed = 0;
    a->last_send = idemp_now_ms();
    if (a->settled != NULL)
        memset(a->settled, 0, a->settled_cap);
    return IDEM_OK;
}

int idemp_amqp_connect(idemp_amqp_t *a, bool confirms, idem_error_t *err)
{
    int rc = IDEM_ERR_AMQP_CONNECT;
    for (int i = 0; i < a->nurls; i++) {
        idem_error_t e = {0};
        rc = connect_url(a, confirms, &e);
        if (rc == IDEM_OK) {
            const idemp_amqp_url_t *u = &a->urls[a->cur];
            char hb[16];
            snprintf(hb, sizeof hb, "%d", a->heartbeat_s);
            const char *kv[] = {"server",      a->where, "tls", u->tls ? "on" : "off",
                                "heartbeat_s", hb,       NULL};
            idem_log(IDEM_LOG_DEBUG, a->component, kv, "connected to RabbitMQ");
            if (!u->tls && !a->warned_plain && !idemp_host_loopback(u->host)) {
                a->warned_plain = true;
                idem_log(IDEM_LOG_WARN, a->component, kv,
                         "connected to RabbitMQ without TLS (tls=off) on a host that is not "
                         "loopback: the password and every message cross the network in clear "
                         "(use an amqps:// URL)");
            }
            if (u->tls && !u->verify_peer && !a->warned_unverified) {
                a->warned_unverified = true; /* once per process and connection object */
                idem_log(IDEM_LOG_WARN, a->component, kv,
                         "TLS without peer verification (verify=verify_none): the link is "
                         "encrypted, but anyone on the path can pose as the broker");
            }
            return IDEM_OK;
        }
        if (rc == IDEM_ERR_NOMEM || i == a->nurls - 1) {
            if (err != NULL && err->code == 0)
                *err = e;
            break;
        }
        const char *kv[] = {"server", a->where, NULL};
        idem_log(IDEM_LOG_DEBUG, a->component, kv, "%s; trying the next node", e.text);
        a->cur = (a->cur + 1) % a->nurls;
    }
    /* the next round starts with the node after the one that failed last */
    a->cur = (a->cur + 1) % a->nurls;
    return rc;
}

int idemp_amqp_ensure(idemp_amqp_t *a, bool confirms, bool *reconnected, idem_error_t *err)
{
    if (reconnected != NULL)
        *reconnected = false;
    if (a->connected)
        return IDEM_OK;
    int64_t now = idemp_now_ms();
    if (now < a->next_ms)
        return idem_error_set(err, IDEM_ERR_AMQP_CONNECT, "RabbitMQ at %s: waiting to reconnect",
                              a->where);
    idem_error_t e = {0};
    if (idemp_amqp_connect(a, confirms, &e) == IDEM_OK) {
        a->connected_at = now;
        if (reconnected != NULL)
            *reconnected = a->was_up;
        a->was_up = true;
        a->failing = false;
        return IDEM_OK;
    }
    int64_t wait = idemp_backoff_next(&a->backoff);
    if (wait < a->backoff.base_ms)
        wait = a->backoff.base_ms;
    a->next_ms = now + wait;
    char w[32];
    snprintf(w, sizeof w, "%lld", (long long)wait);
    const char *kv[] = {"server", a->where, "retry_in_ms", w, NULL};
    idem_log(a->failing ? IDEM_LOG_DEBUG : IDEM_LOG_WARN, a->component, kv, "%s", e.text);
    a->failing = true;
    if (err != NULL && err->code == 0)
        *err = e;
    return e.code;
}

int64_t idemp_amqp_retry_in_ms(const idemp_amqp_t *a)
{
    if (a->connected)
        return 0;
    int64_t left = a->next_ms - idemp_now_ms();
    return left > 0 ? left : 0;
}

void idemp_amqp_keepalive(idemp_amqp_t *a)
{
    if (!a->connected || a->heartbeat_s <= 0)
        return;
    int64_t now = idemp_now_ms();
    if (now - a->last_send < (int64_t)a->heartbeat_s * 500)
        return;
    amqp_frame_t hb;
    memset(&hb, 0, sizeof hb);
    hb.frame_type = AMQP_FRAME_HEARTBEAT;
    hb.channel = 0;
    if (amqp_send_frame(a->conn, &hb) != AMQP_STATUS_OK)
        a->connected = false; /* noticed by the next read */
    a->last_send = now;
}

int idemp_amqp_ack(idemp_amqp_t *a, uint64_t tag, bool multiple, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    int rc = amqp_basic_ack(a->conn, IDEMP_CHANNEL, tag, multiple);
    if (rc != AMQP_STATUS_OK)
        return idemp_amqp_lost(a, rc, "basic.ack", err);
    a->last_send = idemp_now_ms();
    return IDEM_OK;
}
