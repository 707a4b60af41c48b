/* rmq.h - the RabbitMQ adapter over librabbitmq: a connection object that keeps its URL,
 * declares topology, publishes with confirms, consumes and acks. One channel (1) per
 * connection. Failures are sorted into "refused" (IDEM_ERR_AMQP: the channel or connection was
 * closed by the broker) and "lost" (IDEM_ERR_AMQP_LOST: the socket is gone); both need a
 * reconnect, only the first names a fault of ours. */
#ifndef IDEM_RMQ_H
#define IDEM_RMQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <amqp.h>

#include <idem/error.h>

typedef struct idemp_amqp_url {
    char host[256];
    int port;
    char user[128];
    char password[128];
    char vhost[128];
} idemp_amqp_url_t;

/* amqp://[user[:password]@]host[:port][/vhost]; an empty or "/" path and "%2f" mean vhost "/".
 * Percent-escapes are decoded. IDEM_ERR_INVALID on a malformed URL. */
int idemp_amqp_url_parse(const char *url, idemp_amqp_url_t *out);

typedef struct idemp_amqp idemp_amqp_t;

idemp_amqp_t *idemp_amqp_new(const char *url, idem_error_t *err);
void idemp_amqp_free(idemp_amqp_t *a);

/* Connects, logs in, opens channel 1, and with confirms enables publisher confirms. One
 * attempt. IDEM_ERR_AMQP_CONNECT: "cannot connect to RabbitMQ at HOST:PORT: REASON". */
int idemp_amqp_connect(idemp_amqp_t *a, bool confirms, idem_error_t *err);
void idemp_amqp_disconnect(idemp_amqp_t *a);
bool idemp_amqp_connected(const idemp_amqp_t *a);
const char *idemp_amqp_where(const idemp_amqp_t *a);

int idemp_amqp_declare_exchange(idemp_amqp_t *a, const char *name, idem_error_t *err);
/* Durable queue; quorum selects x-queue-type=quorum; dlq (optional) names the queue that the
 * broker dead-letters to (via the default exchange). */
int idemp_amqp_declare_queue(idemp_amqp_t *a, const char *name, bool quorum, const char *dlq,
                             idem_error_t *err);
int idemp_amqp_bind(idemp_amqp_t *a, const char *queue, const char *exchange, const char *key,
                    idem_error_t *err);
int idemp_amqp_consume(idemp_amqp_t *a, const char *queue, int prefetch, idem_error_t *err);

/* Publishes one message; *tag receives its confirm sequence number (confirm mode only). */
int idemp_amqp_publish(idemp_amqp_t *a, const char *exchange, const char *routing_key,
                       bool mandatory, const amqp_basic_properties_t *props, const void *body,
                       size_t len, uint64_t *tag, idem_error_t *err);

/* Confirm events delivered to wait_confirms' callback. For IDEM_CONFIRM_RETURN, returned is the
 * returned message (borrowed for the call); the broker's ack for it follows. */
typedef enum { IDEMP_CONFIRM_ACK, IDEMP_CONFIRM_NACK, IDEMP_CONFIRM_RETURN } idemp_confirm_kind;
typedef void (*idemp_confirm_fn)(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                                 const amqp_message_t *returned);

/* Reads confirm frames until every tag up to last_tag is acked or nacked, or timeout_ms passes
 * (IDEM_ERR_TIMEOUT). */
int idemp_amqp_wait_confirms(idemp_amqp_t *a, uint64_t last_tag, int64_t timeout_ms,
                             idemp_confirm_fn fn, void *ud, idem_error_t *err);

/* Next delivery into env (caller destroys with amqp_destroy_envelope), waiting up to timeout_ms
 * (0 = only what is already there). IDEM_ERR_TIMEOUT when none arrived. */
int idemp_amqp_next(idemp_amqp_t *a, amqp_envelope_t *env, int64_t timeout_ms, idem_error_t *err);
bool idemp_amqp_buffered(idemp_amqp_t *a);
int idemp_amqp_ack(idemp_amqp_t *a, uint64_t tag, bool multiple, idem_error_t *err);

#endif
