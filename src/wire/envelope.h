/* envelope.h - validating a delivery before any database work: size, event id, event type,
 * JSON body, dedup-window age. Pure logic over plain strings (no AMQP types), so it is tested
 * without servers. */
#ifndef IDEM_ENVELOPE_H
#define IDEM_ENVELOPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

/* Dead-letter codes of the contract; their names are the wire text of x-idem-error. */
typedef enum idemp_dl_code {
    IDEMP_DL_NONE = 0,
    IDEMP_DL_MALFORMED_JSON,
    IDEMP_DL_MISSING_EVENT_ID,
    IDEMP_DL_INVALID_EVENT_ID,
    IDEMP_DL_UNKNOWN_TYPE,
    IDEMP_DL_OVERSIZED,
    IDEMP_DL_INVALID_PAYLOAD,
    IDEMP_DL_HANDLER_REJECTED,
    IDEMP_DL_RETRIES_EXHAUSTED,
    IDEMP_DL_STALE,
    IDEMP_DL_UNTRUSTED,
    IDEMP_DL_CONFLICT,
    IDEMP_DL_COUNT
} idemp_dl_code;

const char *idemp_dl_code_name(idemp_dl_code code); /* "malformed_json", ...; "" for NONE */

/* A string field of the delivery; ptr NULL when absent. Not NUL-terminated. */
typedef struct idemp_str {
    const char *ptr;
    size_t len;
} idemp_str_t;

typedef struct idemp_envelope_in {
    idemp_str_t message_id;     /* property */
    idemp_str_t user_id;        /* property: the publisher's RabbitMQ user, as the broker checked */
    idemp_str_t hdr_event_id;   /* header "event_id" (string kinds only) */
    bool hdr_event_id_bad_kind; /* header present but not a string */
    idemp_str_t type;           /* property */
    idemp_str_t hdr_event_type; /* header "event_type" */
    idemp_str_t routing_key;
    idemp_str_t hdr_subscription_id; /* header "subscription_id" */
    bool has_seq;                    /* header "x-idem-seq", an integer */
    int64_t seq;
    bool has_timestamp;
    uint64_t timestamp; /* the property as sent: seconds since the epoch, unsigned */
    const char *body;   /* NULL when the body was not read (oversized) */
    size_t body_len;
    uint64_t body_size; /* as declared by the content header */
} idemp_envelope_in_t;

typedef struct idemp_envelope {
    char event_id[37]; /* lowercase canonical */
    char event_type[256];
    json_t *payload;          /* new reference: a JSON object */
    char subscription_id[37]; /* the subscription_id header, else the payload's, when a UUID */
    bool has_seq;
    int64_t seq;
    bool has_timestamp; /* a usable timestamp: not negative, at most a day ahead of now */
    int64_t timestamp_s;
} idemp_envelope_t;

/* Validates in. On IDEMP_DL_NONE, out is filled (caller json_decrefs out->payload). Otherwise
 * detail receives the reason and out->payload is NULL. now_ms is wall-clock time, only used to
 * tell a usable timestamp (see idemp_envelope_timestamp). The event type is not checked against
 * handlers here (the caller knows them), nor is the age against the dedup window: that is
 * decided by the database clock, in the claim. */
idemp_dl_code idemp_envelope_parse(const idemp_envelope_in_t *in, int64_t max_bytes, int64_t now_ms,
                                   idemp_envelope_t *out, char *detail, size_t detail_sz);

/* Is user_id (the property; ptr NULL when absent) one of trusted (NULL-terminated user names)?
 * When not, detail receives why: which user_id it was (printable, bounded), or that it is absent. A
 * NULL or empty list trusts every publisher. */
bool idemp_envelope_trusted(idemp_str_t user_id, const char *const *trusted, char *detail,
                            size_t detail_sz);

/* A timestamp property is usable when it is not negative as a signed 64-bit number and at most a
 * day after now (seconds, milliseconds or nanoseconds sent by mistake land far in the future);
 * an unusable one counts as absent. */
bool idemp_envelope_timestamp(uint64_t raw, int64_t now_ms, int64_t *out_s);

#endif
