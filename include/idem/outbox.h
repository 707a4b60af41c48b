/* idem/outbox.h - emitting events through the transactional outbox. */
#ifndef IDEM_OUTBOX_H
#define IDEM_OUTBOX_H

#include <jansson.h>
#include <libpq-fe.h>

#include <idem/error.h>

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_UUID_LEN 36

/* Queues one event in the caller's open transaction on conn (borrowed) through the SQL function
 * idem_emit: the event id is md5(dedup_key)::uuid, so emitting the same dedup key twice leaves
 * one row. The row becomes visible to relays when the caller commits. payload is borrowed and
 * must be a JSON object. On success writes the event id (36 chars + NUL) to event_id_out. */
/* Errors: IDEM_ERR_INVALID (a missing argument or a payload that is not an object),
 * IDEM_ERR_PG_QUERY with err->sqlstate 22023 (an event type not 1-255 bytes, bad headers) or
 * 23505 (the dedup key was used for another event type or subscription), IDEM_ERR_PG_LOST,
 * IDEM_ERR_NOMEM. */
int idem_emit(PGconn *conn, const char *event_type, const char *subscription_id,
              const char *dedup_key, const json_t *payload, char event_id_out[IDEM_UUID_LEN + 1],
              idem_error_t *err);

/* idem_emit with message headers: headers (borrowed, may be NULL) is a flat JSON object of
 * string values carried as AMQP headers of the published message, e.g. {"traceparent": "00-..."};
 * names starting with "x-idem-" are refused (22023). */
int idem_emit_with_headers(PGconn *conn, const char *event_type, const char *subscription_id,
                           const char *dedup_key, const json_t *payload, const json_t *headers,
                           char event_id_out[IDEM_UUID_LEN + 1], idem_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
