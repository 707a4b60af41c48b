/* envelope.c - validating a delivery before any database work. */
#include <stdio.h>
#include <string.h>

#include "envelope.h"
#include "uuid.h"

static const char *const dl_names[IDEMP_DL_COUNT] = {
    "",          "malformed_json",  "missing_event_id", "invalid_event_id",  "unknown_type",
    "oversized", "invalid_payload", "handler_rejected", "retries_exhausted", "stale",
    "untrusted", "conflict",
};

const char *idemp_dl_code_name(idemp_dl_code code)
{
    return (code >= 0 && code < IDEMP_DL_COUNT) ? dl_names[code] : "";
}

static bool present(idemp_str_t s)
{
    return s.ptr != NULL && s.len > 0;
}

/* Printable, bounded copy of a field for a detail message. */
static void show(idemp_str_t s, char *out, size_t sz)
{
    size_t o = 0;
    for (size_t i = 0; i < s.len && o + 4 < sz; i++) {
        unsigned char ch = (unsigned char)s.ptr[i];
        out[o++] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
    }
    if (s.len > 0 && o + 4 >= sz)
        memcpy(out + o - 3, "...", 3);
    out[o] = '\0';
}

bool idemp_envelope_trusted(idemp_str_t user_id, const char *const *trusted, char *detail,
                            size_t detail_sz)
{
    if (trusted == NULL || trusted[0] == NULL)
        return true;
    if (user_id.ptr == NULL) {
        snprintf(detail, detail_sz,
                 "user_id is absent: the publisher is not known, and only trusted publishers' "
                 "messages are accepted");
        return false;
    }
    for (const char *const *t = trusted; *t != NULL; t++)
        if (strlen(*t) == user_id.len && memcmp(*t, user_id.ptr, user_id.len) == 0)
            return true;
    char buf[80];
    show(user_id, buf, sizeof buf);
    snprintf(detail, detail_sz, "user_id '%s' is not a trusted publisher", buf);
    return false;
}

bool idemp_envelope_timestamp(uint64_t raw, int64_t now_ms, int64_t *out_s)
{
    if (raw > (uint64_t)INT64_MAX)
        return false;
    int64_t ts = (int64_t)raw;
    if (ts > now_ms / 1000 + 86400)
        return false;
    *out_s = ts;
    return true;
}

idemp_dl_code idemp_envelope_parse(const idemp_envelope_in_t *in, int64_t max_bytes, int64_t now_ms,
                                   idemp_envelope_t *out, char *detail, size_t detail_sz)
{
    char buf[80];
    memset(out, 0, sizeof *out);
    detail[0] = '\0';

    uint64_t size = in->body != NULL ? in->body_len : in->body_size;
    if (size > (uint64_t)max_bytes) {
        snprintf(detail, detail_sz, "body is %llu bytes, limit %lld", (unsigned long long)size,
                 (long long)max_bytes);
        return IDEMP_DL_OVERSIZED;
    }

    idemp_str_t id = in->message_id;
    const char *id_src = "message_id";
    if (!present(id)) {
        if (in->hdr_event_id_bad_kind) {
            snprintf(detail, detail_sz, "event_id header is not a string");
            return IDEMP_DL_INVALID_EVENT_ID;
        }
        id = in->hdr_event_id;
        id_src = "event_id header";
    }
    if (!present(id)) {
        snprintf(detail, detail_sz, "no message_id property and no event_id header");
        return IDEMP_DL_MISSING_EVENT_ID;
    }
    if (!idemp_uuid_normalize(id.ptr, id.len, out->event_id)) {
        show(id, buf, sizeof buf);
        snprintf(detail, detail_sz, "%s '%s' is not a UUID", id_src, buf);
        return IDEMP_DL_INVALID_EVENT_ID;
    }

    idemp_str_t type = present(in->type)             ? in->type
                       : present(in->hdr_event_type) ? in->hdr_event_type
                                                     : in->routing_key;
    if (type.ptr == NULL)
        type.len = 0;
    if (type.len >= sizeof out->event_type) {
        snprintf(detail, detail_sz, "event type is %zu bytes long", type.len);
        return IDEMP_DL_UNKNOWN_TYPE;
    }
    if (type.len > 0 && memchr(type.ptr, '\0', type.len) != NULL) {
        snprintf(detail, detail_sz, "event type holds a NUL byte");
        return IDEMP_DL_UNKNOWN_TYPE; /* not the type before the NUL: no handler has this name */
    }
    if (type.len > 0)
        memcpy(out->event_type, type.ptr, type.len);
    out->event_type[type.len] = '\0';

    json_error_t jerr;
    json_t *doc = json_loadb(in->body ? in->body : "", in->body_len,
                             JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (doc == NULL) {
        snprintf(detail, detail_sz, "line %d column %d: %s", jerr.line, jerr.column, jerr.text);
        return IDEMP_DL_MALFORMED_JSON;
    }
    if (!json_is_object(doc)) {
        snprintf(detail, detail_sz, "payload is a JSON %s, not an object",
                 json_is_array(doc)    ? "array"
                 : json_is_string(doc) ? "string"
                 : json_is_number(doc) ? "number"
                                       : "literal");
        json_decref(doc);
        return IDEMP_DL_INVALID_PAYLOAD;
    }

    out->has_timestamp =
        in->has_timestamp && idemp_envelope_timestamp(in->timestamp, now_ms, &out->timestamp_s);
    out->has_seq = in->has_seq;
    out->seq = in->seq;

    /* the order key: the relay's header names the subscription even when the payload does not */
    if (present(in->hdr_subscription_id) &&
        idemp_uuid_normalize(in->hdr_subscription_id.ptr, in->hdr_subscription_id.len,
                             out->subscription_id)) {
        out->payload = doc;
        return IDEMP_DL_NONE;
    }
    const char *sub = json_string_value(json_object_get(doc, "subscription_id"));
    if (sub == NULL || !idemp_uuid_normalize(sub, strlen(sub), out->subscription_id))
        out->subscription_id[0] = '\0';
    out->payload = doc;
    return IDEMP_DL_NONE;
}
