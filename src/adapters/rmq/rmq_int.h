/* rmq_int.h - what the RabbitMQ adapter's files (rmq.c, rmq_socket.c, rmq_topology.c,
 * rmq_confirm.c, rmq_deliver.c, rmq_publish.c) share. Not for other modules. */
#ifndef IDEM_RMQ_INT_H
#define IDEM_RMQ_INT_H

#include <amqp.h>
#include <amqp_framing.h>

#include "backoff.h"
#include "rmq.h"

#define IDEMP_CHANNEL 1
#define IDEMP_FRAME_MAX 131072

struct idemp_amqp {
    idemp_amqp_url_t urls[IDEMP_AMQP_URLS_MAX];
    int nurls, cur;
    const char *component;
    int heartbeat_s;        /* requested */
    bool warned_unverified; /* the verify_none warning was logged */
    bool warned_plain;      /* the tls=off warning (a host that is not loopback) was logged */
    char where[300];
    amqp_connection_state_t conn;
    bool connected;
    bool confirms;
    bool corked;        /* TCP_CORK on: publishes gather in full segments until idemp_amqp_flush */
    int close_code;     /* reply code of the last channel/connection close by the broker */
    int64_t last_send;  /* monotonic ms of our last frame sent (for keepalive) */
    uint64_t next_tag;  /* next publish sequence number in confirm mode */
    uint64_t confirmed; /* all tags <= confirmed are settled */
    uint8_t *settled;   /* settled[i]: tag confirmed + 1 + i settled out of order */
    size_t settled_cap;
    uint64_t body_left; /* bytes of an unread (oversized) body still on the wire */
    uint8_t *scratch;   /* IDEMP_FRAME_MAX bytes for measuring encoded properties */
    idemp_backoff_t backoff;
    int64_t next_ms;
    bool was_up, failing;
    int64_t connected_at; /* monotonic ms of the last successful connect */
};

struct idemp_msg {
    uint64_t tag;
    bool redelivered;
    amqp_bytes_t exchange, routing_key; /* in pool */
    amqp_bytes_t consumer_tag;          /* in pool; empty for basic.get */
    amqp_pool_t pool;                   /* owns the cloned properties */
    amqp_basic_properties_t props;
    amqp_bytes_t body; /* malloc'd; empty when not read */
    uint64_t body_size;
    bool oversized;
};

/* Checks an RPC reply; on failure the connection is marked unusable (a broker refusal is
 * answered with close-ok first). */
int idemp_amqp_check_rpc(idemp_amqp_t *a, amqp_rpc_reply_t r, const char *what, idem_error_t *err);
/* Marks the connection unusable and returns an IDEM_ERR_AMQP_LOST error naming what failed. */
int idemp_amqp_lost(idemp_amqp_t *a, int amqp_status, const char *what, idem_error_t *err);
/* Answers a connection.close or channel.close frame and returns IDEM_ERR_AMQP. */
int idemp_amqp_on_close(idemp_amqp_t *a, const amqp_frame_t *f, idem_error_t *err);
/* amqp_simple_wait_frame_noblock with a timeout in ms; IDEM_ERR_TIMEOUT when nothing arrived. */
int idemp_amqp_wait_frame(idemp_amqp_t *a, amqp_frame_t *f, int64_t timeout_ms, idem_error_t *err);
/* The next frame of the message being read: a content header or body frame (want) on our
 * channel; a close is answered; anything else breaks the protocol. */
int idemp_amqp_content_frame(idemp_amqp_t *a, int want, amqp_frame_t *f, idem_error_t *err);
/* Bookkeeping after a publish: assigns the tag. */
void idemp_amqp_published(idemp_amqp_t *a, uint64_t *tag);
/* ---- rmq_socket.c ---- */

/* A TLS socket on conn per u's parameters, or NULL with why set. */
amqp_socket_t *idemp_amqp_tls_socket(amqp_connection_state_t conn, const idemp_amqp_url_t *u,
                                     char *why, size_t whysz);
/* Why a connect to host:port failed (librabbitmq status amqp_rc), into out. */
void idemp_amqp_tcp_reason(const char *host, int port, int amqp_rc, char *out, size_t sz);
/* Appends to out why the TLS handshake failed, when u is a TLS URL and a reason is known. */
void idemp_amqp_tls_detail(const idemp_amqp_url_t *u, bool after_handshake, char *out, size_t sz);

/* Waits for the confirm of tag (ack: IDEM_OK; nack or return: IDEM_ERR_AMQP). */
int idemp_amqp_confirm_one(idemp_amqp_t *a, uint64_t tag, int64_t timeout_ms, idem_error_t *err);

#endif
