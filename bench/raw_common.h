/* raw_common.h - what the two raw librabbitmq tools (raw_publish, raw_consume) share: error
 * exits, RPC reply checks, a monotonic clock and the connect + login + channel.open sequence.
 * Header-only: each tool is one file built on its own. Define RAW_TOOL (the tool's name) first. */
#ifndef RAW_COMMON_H
#define RAW_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/time.h>

#include <amqp.h>
#include <amqp_framing.h>
#include <amqp_tcp_socket.h>

#define CH 1

static amqp_connection_state_t conn;

static void die(const char *what, const char *detail)
{
    fprintf(stderr, RAW_TOOL ": %s: %s\n", what, detail ? detail : "failed");
    exit(1);
}

/* 0 for a normal reply; 404 when the broker closed the channel with NOT_FOUND and allow_404 is
 * set; any other failure exits. */
static int check_reply_404(const char *what, int allow_404)
{
    amqp_rpc_reply_t r = amqp_get_rpc_reply(conn);
    if (r.reply_type == AMQP_RESPONSE_NORMAL)
        return 0;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION)
        die(what, amqp_error_string2(r.library_error));
    if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION && r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
        amqp_channel_close_t *m = r.reply.decoded;
        if (allow_404 && m->reply_code == 404)
            return 404;
        fprintf(stderr, RAW_TOOL ": %s: channel closed: %.*s\n", what, (int)m->reply_text.len,
                (char *)m->reply_text.bytes);
        exit(1);
    }
    if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
        r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
        amqp_connection_close_t *m = r.reply.decoded;
        fprintf(stderr, RAW_TOOL ": %s: connection closed: %.*s\n", what, (int)m->reply_text.len,
                (char *)m->reply_text.bytes);
        exit(1);
    }
    die(what, "unexpected reply");
    return 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The user raw_connect logged in as (what RabbitMQ checks a message's user_id against). */
static char raw_user[256];

/* Connects to url (amqp://user:pass@host:port/vhost), logs in and opens channel CH, or exits. */
static void raw_connect(const char *url)
{
    struct amqp_connection_info ci;
    char *url_copy = strdup(url);
    if (url_copy == NULL || amqp_parse_url(url_copy, &ci) != AMQP_STATUS_OK)
        die("bad URL", url);
    const char *vhost = (ci.vhost == NULL || *ci.vhost == '\0') ? "/" : ci.vhost;
    conn = amqp_new_connection();
    amqp_socket_t *sock = amqp_tcp_socket_new(conn);
    if (sock == NULL)
        die("socket", NULL);
    struct timeval cto = {10, 0};
    int rc = amqp_socket_open_noblock(sock, ci.host, ci.port, &cto);
    if (rc != AMQP_STATUS_OK)
        die("connect", amqp_error_string2(rc));
    amqp_rpc_reply_t lr =
        amqp_login(conn, vhost, 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, ci.user, ci.password);
    if (lr.reply_type != AMQP_RESPONSE_NORMAL)
        die("login", "refused or failed");
    snprintf(raw_user, sizeof raw_user, "%s", ci.user);
    free(url_copy); /* amqp_login copied what it needs */
    amqp_channel_open(conn, CH);
    check_reply_404("channel.open", 0);
}

#endif
