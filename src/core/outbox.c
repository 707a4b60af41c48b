/* outbox.c - emitting through the transactional outbox from C. */
#include <stdlib.h>
#include <string.h>

#include <idem/outbox.h>

#include "pg.h"

#define SQL_EMIT "SELECT idem.idem_emit($1, $2::uuid, $3, $4::jsonb, $5::jsonb)"

int idem_emit(PGconn *conn, const char *event_type, const char *subscription_id,
              const char *dedup_key, const json_t *payload, char event_id_out[IDEM_UUID_LEN + 1],
              idem_error_t *err)
{
    return idem_emit_with_headers(conn, event_type, subscription_id, dedup_key, payload, NULL,
                                  event_id_out, err);
}

int idem_emit_with_headers(PGconn *conn, const char *event_type, const char *subscription_id,
                           const char *dedup_key, const json_t *payload, const json_t *headers,
                           char event_id_out[IDEM_UUID_LEN + 1], idem_error_t *err)
{
    if (conn == NULL || event_type == NULL || *event_type == '\0' || subscription_id == NULL ||
        dedup_key == NULL || *dedup_key == '\0' || !json_is_object(payload))
        return idem_error_set(err, IDEM_ERR_INVALID,
                              "idem_emit needs a connection, an event type, a subscription id, "
                              "a dedup key and a JSON object payload");
    if (headers != NULL && !json_is_object(headers))
        return idem_error_set(err, IDEM_ERR_INVALID, "idem_emit: headers must be a JSON object");
    char *body = json_dumps(payload, JSON_COMPACT);
    char *hdr = headers != NULL ? json_dumps(headers, JSON_COMPACT) : NULL;
    if (body == NULL || (headers != NULL && hdr == NULL)) {
        free(body);
        free(hdr);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    const char *params[] = {event_type, subscription_id, dedup_key, body, hdr};
    idemp_rows_t *res;
    int rc = idemp_pgconn_exec(conn, SQL_EMIT, 5, params, &res, err);
    free(body);
    free(hdr);
    if (rc != IDEM_OK)
        return rc;
    const char *id = idemp_rows_count(res) == 1 ? idemp_rows_get(res, 0, 0) : "";
    if (strlen(id) != IDEM_UUID_LEN) {
        idemp_rows_free(res);
        return idem_error_set(err, IDEM_ERR_PG_QUERY, "idem_emit returned no event id");
    }
    memcpy(event_id_out, id, IDEM_UUID_LEN + 1);
    idemp_rows_free(res);
    return IDEM_OK;
}
