/* rmq.h - the RabbitMQ adapter, the only module that speaks librabbitmq.
 *
 * A connection object keeps its URL list (the nodes of a cluster, tried in turn), its heartbeat
 * and its state: it connects on demand with backoff, states a reason when it drops the
 * connection, declares topology, publishes with confirms, and reads deliveries itself so that
 * the size of a body is known from its content header before the body is read. Deliveries are
 * idemp_msg_t objects (owned copies of properties, headers and body); the adapter maps them to
 * envelope fields, builds the dead-letter copy and the relay's publish properties. One channel
 * per connection. Failures are sorted into "refused" (IDEM_ERR_AMQP: the broker closed the
 * channel or connection; idemp_amqp_close_code() gives its reply code), "lost"
 * (IDEM_ERR_AMQP_LOST) and "cannot be encoded" (IDEM_ERR_UNENCODABLE: nothing was sent). */
#ifndef IDEM_RMQ_H
#define IDEM_RMQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include <idem/error.h>

#include "envelope.h"

#define IDEMP_AMQP_URLS_MAX 16

typedef struct idemp_amqp_url {
    bool tls;
    char host[256];
    int port;
    char user[128];
    char password[128];
    char vhost[128];
    int heartbeat_s; /* heartbeat=SECONDS in the query, -1 when absent */
    char cacertfile[256], certfile[256], keyfile[256], sni[256];
    bool verify_peer; /* verify=verify_peer (default) or verify_none */
} idemp_amqp_url_t;

/* amqp[s]://[user[:password]@]host[:port][/vhost][?query]; an empty or "/" path and "%2f" mean
 * vhost "/". Percent-escapes are decoded. Query keys: heartbeat, cacertfile, certfile, keyfile,
 * verify, server_name_indication (others are ignored). IDEM_ERR_INVALID when malformed. */
int idemp_amqp_url_parse(const char *url, idemp_amqp_url_t *out);

typedef struct idemp_amqp idemp_amqp_t;

/* urls: one URL or a comma-separated list (copied). component names the log lines. heartbeat_s:
 * seconds, 0 = off, -1 = the URL's heartbeat= or else 30. NULL with err set on a bad URL. */
idemp_amqp_t *idemp_amqp_new(const char *urls, const char *component, int heartbeat_s,
                             idem_error_t *err);
void idemp_amqp_free(idemp_amqp_t *a);
/* Overrides the password of every URL (from a password file); copied. */
int idemp_amqp_set_password(idemp_amqp_t *a, const char *password);
/* A reload: asks fn (NULL: none) for the password and sets it on a[0..n), used from their next
 * connection on. Returns "re-read", "not configured" (no fn, or fn has none), or "kept" (fn could
 * not read it, or it is too long: logged at warn level under component, the old one stays). */
const char *idemp_amqp_reload_password(idemp_amqp_t *const *a, int n,
                                       int (*fn)(void *, char *, size_t, idem_error_t *), void *ud,
                                       const char *component);

/* One connection attempt per URL, starting with the one that worked last: logs in, opens
 * channel 1, and with confirms enables publisher confirms. IDEM_ERR_AMQP_CONNECT: "cannot connect
 * to RabbitMQ at HOST:PORT: REASON" (the last URL tried). */
int idemp_amqp_connect(idemp_amqp_t *a, bool confirms, idem_error_t *err);
/* Connects when down and due, with backoff between failed rounds (each logged once with its
 * reason). IDEM_OK when connected; *reconnected when this call reconnected after a loss. */
int idemp_amqp_ensure(idemp_amqp_t *a, bool confirms, bool *reconnected, idem_error_t *err);
int64_t idemp_amqp_retry_in_ms(const idemp_amqp_t *a);
/* Drops the connection; the broker requeues what was delivered and not acked. With a reason
 * (logged once at warn level) the socket is just closed; without one (a clean shutdown) the
 * channel and connection are closed with their handshakes. */
void idemp_amqp_disconnect(idemp_amqp_t *a, const char *reason);
bool idemp_amqp_connected(const idemp_amqp_t *a);
const char *idemp_amqp_where(const idemp_amqp_t *a); /* "host:port" of the current node */
bool idemp_amqp_tls(const idemp_amqp_t *a);          /* the current node's URL is amqps:// */
int idemp_amqp_socket(const idemp_amqp_t *a);        /* -1 when not connected */
int idemp_amqp_close_code(const idemp_amqp_t *a);    /* reply code of the last broker close */
bool idemp_amqp_buffered(const idemp_amqp_t *a);     /* frames already read, not yet handled */

/* Services the link without blocking: reads what has arrived (confirms of nothing, a close) and
 * sends a heartbeat when one is due. For connections that do not consume. */
int idemp_amqp_service(idemp_amqp_t *a, idem_error_t *err);
/* Sends a heartbeat if half the heartbeat interval passed since we last sent anything; reads
 * nothing. For a consumer busy in the database between reads. */
void idemp_amqp_keepalive(idemp_amqp_t *a);

/* ---- shards ---- */

/* The shard of a subscription (see CONTRACT "Messages on the wire"): the first 4 bytes of
 * md5(its lowercase canonical text), big-endian unsigned, modulo IDEMP_SHARDS; its key
 * idem.shard.N is what the relay sends in BCC. -1 if subscription_id is not a UUID. */
#define IDEMP_SHARDS 1024
int idemp_amqp_shard(const char *subscription_id);

/* ---- topology (passive = only check that it exists: IDEM_ERR_NOT_FOUND if not) ---- */

typedef struct idemp_queue_spec {
    bool quorum;
    bool single_active; /* x-single-active-consumer */
    const char *dlx;    /* x-dead-letter-exchange, or NULL */
    const char *dlk;    /* x-dead-letter-routing-key, or NULL */
} idemp_queue_spec_t;

/* type: "topic", "direct" or "fanout"; alternate: its alternate-exchange, or NULL. */
int idemp_amqp_declare_exchange(idemp_amqp_t *a, const char *name, const char *type,
                                const char *alternate, bool passive, idem_error_t *err);
int idemp_amqp_declare_queue(idemp_amqp_t *a, const char *name, const idemp_queue_spec_t *spec,
                             bool passive, idem_error_t *err);
/* Deletes exchange name unless queues or exchanges are bound to it (then *in_use, IDEM_OK); a
 * missing one counts as deleted. */
int idemp_amqp_delete_unused_exchange(idemp_amqp_t *a, const char *name, bool *in_use,
                                      idem_error_t *err);
int idemp_amqp_bind(idemp_amqp_t *a, const char *queue, const char *exchange, const char *key,
                    idem_error_t *err);
/* queue.bind without waiting for the answer: a refusal closes the channel, which the next
 * synchronous call reports (end a run of these with idemp_amqp_bind). */
int idemp_amqp_bind_nowait(idemp_amqp_t *a, const char *queue, const char *exchange,
                           const char *key, idem_error_t *err);
int idemp_amqp_bind_exchange(idemp_amqp_t *a, const char *dest, const char *source, const char *key,
                             idem_error_t *err);
int idemp_amqp_qos(idemp_amqp_t *a, int prefetch, idem_error_t *err);
int idemp_amqp_consume(idemp_amqp_t *a, const char *queue, idem_error_t *err);

/* ---- deliveries ---- */

typedef struct idemp_msg idemp_msg_t;

/* Next delivery, waiting up to timeout_ms (0 = only what has arrived). A body longer than
 * max_body is not read: the message comes back with idemp_msg_oversized() true and its body
 * still on the wire, and the caller must stream it away with idemp_amqp_dead_letter() before
 * the next read (or the next read drops it). IDEM_ERR_TIMEOUT when none arrived; on failure the
 * connection is down. *out is new (idemp_msg_free). */
int idemp_amqp_next(idemp_amqp_t *a, int64_t max_body, int64_t timeout_ms, idemp_msg_t **out,
                    idem_error_t *err);
void idemp_msg_free(idemp_msg_t *m); /* NULL is a no-op */
uint64_t idemp_msg_tag(const idemp_msg_t *m);
bool idemp_msg_oversized(const idemp_msg_t *m);
uint64_t idemp_msg_body_size(const idemp_msg_t *m);
/* Fills in from the message's properties, headers, routing key and body (all borrowed from m). */
void idemp_msg_envelope_in(const idemp_msg_t *m, idemp_envelope_in_t *in);
/* A string header (borrowed, not NUL-terminated) or NULL. */
const char *idemp_msg_header(const idemp_msg_t *m, const char *name, size_t *len);
/* The string headers as a JSON object text (new, free()), others left out; NULL on OOM. */
char *idemp_msg_headers_json(const idemp_msg_t *m);
/* For an operator to read (rmq_describe.c): {properties, headers (every kind), routing_key,
 * body_bytes, body (null when not read), body_escaped}; text that is not UTF-8 is escaped.
 * New reference, NULL on OOM. */
json_t *idemp_msg_describe(const idemp_msg_t *m);

int idemp_amqp_ack(idemp_amqp_t *a, uint64_t tag, bool multiple, idem_error_t *err);

/* basic.get (acked later with idemp_amqp_ack, or given back when the connection closes):
 * IDEM_ERR_NOT_FOUND when the queue is empty; *out is new (idemp_msg_free). */
int idemp_amqp_get(idemp_amqp_t *a, const char *queue, int64_t max_body, idemp_msg_t **out,
                   idem_error_t *err);
/* Messages ready in queue (a passive declare). IDEM_ERR_NOT_FOUND when it does not exist. */
int idemp_amqp_queue_depth(idemp_amqp_t *a, const char *queue, uint32_t *messages,
                           idem_error_t *err);
/* The same, with the number of consumers the broker counts on it (active or standing by). */
int idemp_amqp_queue_info(idemp_amqp_t *a, const char *queue, uint32_t *messages,
                          uint32_t *consumers, idem_error_t *err);
bool idemp_msg_header_int(const idemp_msg_t *m, const char *name, int64_t *out);
/* Was m delivered by the consumer of queue (basic.consume's tag is the queue's name)? */
bool idemp_msg_from_queue(const idemp_msg_t *m, const char *queue);
/* Was m published to exchange (the exchange it was first published to)? */
bool idemp_msg_from_exchange(const idemp_msg_t *m, const char *exchange);
bool idemp_msg_timestamp(const idemp_msg_t *m, uint64_t *out);
/* Publishes m again through exchange/routing_key (persistent, mandatory, confirmed): without
 * x-idem-error, with x-idem-requeued counting the moves, and with user_id = out's own login user
 * (the original publisher's, if it had one, stays in the x-idem-original-user-id header). */
int idemp_amqp_requeue(idemp_amqp_t *out, const idemp_msg_t *m, const char *exchange,
                       const char *routing_key, int64_t timeout_ms, idem_error_t *err);

/* Publishes the dead-letter copy of m through exchange/routing_key on out and waits for the
 * broker's confirm: the original body, properties and headers plus x-idem-error = reason, made
 * persistent, without expiration and user_id (kept as x-idem-original-expiration and
 * x-idem-original-user-id headers); if the headers no longer fit a frame, the reason is cut, then
 * the largest original headers are dropped and named in x-idem-dropped-headers. An oversized
 * message's body is streamed frame by frame from in, never held whole. */
int idemp_amqp_dead_letter(idemp_amqp_t *out, idemp_amqp_t *in, idemp_msg_t *m,
                           const char *exchange, const char *routing_key, const char *reason,
                           int64_t timeout_ms, idem_error_t *err);

/* ---- publishing events (the relay) ---- */

typedef struct idemp_event_msg {
    const char *event_id, *subscription_id, *event_type; /* NUL-terminated */
    const char *body;
    size_t body_len;
    int64_t timestamp_s;      /* whole seconds */
    int64_t seq;              /* x-idem-seq */
    const char *headers_json; /* the emit's own headers (a flat JSON object of strings) or NULL */
} idemp_event_msg_t;

/* Publishes e to exchange with routing key = event type, mandatory and persistent, with the
 * contract's properties (user_id = a's own login user) and headers; *tag receives its confirm
 * sequence number. IDEM_ERR_UNENCODABLE (nothing sent, the connection stays up) when e cannot be an
 * AMQP message: an event type over 255 bytes, headers that are not a flat object of strings,
 * properties that do not fit one frame. */
int idemp_amqp_publish_event(idemp_amqp_t *a, const char *exchange, const idemp_event_msg_t *e,
                             uint64_t *tag, idem_error_t *err);

/* Publishes that follow idemp_amqp_cork gather in full TCP segments (TCP_CORK) instead of one
 * small segment each, until idemp_amqp_flush sends what is left; a wait for a frame flushes
 * first. For a loop that publishes many messages at once and then waits. */
void idemp_amqp_cork(idemp_amqp_t *a);
void idemp_amqp_flush(idemp_amqp_t *a);

typedef enum { IDEMP_CONFIRM_ACK, IDEMP_CONFIRM_NACK, IDEMP_CONFIRM_RETURN } idemp_confirm_kind;
/* For IDEMP_CONFIRM_RETURN, tag is 0 and message_id names the returned message (borrowed, may
 * be NULL); the broker's ack for it follows. */
typedef void (*idemp_confirm_fn)(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                                 const char *message_id, size_t message_id_len);

/* Reads the frames that have arrived (confirms, returns, a close) without blocking, calling fn
 * for each confirm and return, and sends a heartbeat when one is due. */
int idemp_amqp_take_confirms(idemp_amqp_t *a, idemp_confirm_fn fn, void *ud, idem_error_t *err);

/* Reads confirm frames until every tag up to last_tag is acked or nacked (IDEM_OK) or timeout_ms
 * passes (IDEM_ERR_TIMEOUT; the connection stays up). */
int idemp_amqp_wait_confirms(idemp_amqp_t *a, uint64_t last_tag, int64_t timeout_ms,
                             idemp_confirm_fn fn, void *ud, idem_error_t *err);

#endif
