/* rmq.c - the RabbitMQ adapter over librabbitmq 0.11: URLs, connections (TCP or TLS) with
 * heartbeats and backoff, topology, confirms. Deliveries and publishes are in rmq_msg.c. */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include <idem/log.h>

#include "clock.h"
#include "rmq_int.h"

#define CONNECT_TIMEOUT_S 10
#define STABLE_MS 10000 /* a connection up this long resets the backoff when it drops */
#define DEFAULT_HEARTBEAT_S 30

/* ---- the connection object ---------------------------------------------------------------- */

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
            /* the URL may hold a password: the error text is masked by idem_error_set */
            idem_error_set(err, IDEM_ERR_INVALID, "invalid AMQP URL: %s", tok);
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

/* A TLS socket per the URL's parameters; verification is on unless verify=verify_none. */
static amqp_socket_t *tls_socket(idemp_amqp_t *a, const idemp_amqp_url_t *u, char *why,
                                 size_t whysz)
{
    amqp_socket_t *sock = amqp_ssl_socket_new(a->conn);
    if (sock == NULL) {
        snprintf(why, whysz, "cannot set up TLS");
        return NULL;
    }
    SSL_CTX *ctx = amqp_ssl_socket_get_context(sock);
    if (u->cacertfile[0] != '\0') {
        if (amqp_ssl_socket_set_cacert(sock, u->cacertfile) != AMQP_STATUS_OK) {
            snprintf(why, whysz, "cannot read cacertfile %s", u->cacertfile);
            return NULL;
        }
    } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
        snprintf(why, whysz, "cannot load the system CA certificates");
        return NULL;
    }
    if (u->certfile[0] != '\0' || u->keyfile[0] != '\0') {
        if (amqp_ssl_socket_set_key(sock, u->certfile, u->keyfile) != AMQP_STATUS_OK) {
            snprintf(why, whysz, "cannot read certfile %s / keyfile %s", u->certfile, u->keyfile);
            return NULL;
        }
    }
    amqp_ssl_socket_set_verify_peer(sock, u->verify_peer);
    if (u->verify_peer && u->sni[0] != '\0') {
        /* verify the certificate against the given name instead of the host we dial */
        amqp_ssl_socket_set_verify_hostname(sock, 0);
        X509_VERIFY_PARAM_set1_host(SSL_CTX_get0_param(ctx), u->sni, 0);
    } else {
        amqp_ssl_socket_set_verify_hostname(sock, u->verify_peer);
    }
    return sock;
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
    amqp_socket_t *sock = u->tls ? tls_socket(a, u, why, sizeof why) : amqp_tcp_socket_new(a->conn);
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
        tcp_reason(u->host, u->port, rc, why, sizeof why);
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
