/* fuzz_envelope.c - libFuzzer target for idemp_envelope_parse (src/wire/envelope.c).
 *
 * Input layout (see make_seeds.py): a flags byte, a limits byte, timestamp (8 bytes LE),
 * now in ms (8 bytes LE), x-idem-seq (8 bytes LE), then length-prefixed fields message_id,
 * event_id header, type, event_type header, routing key, subscription_id header, and the rest is
 * the body. Every field is its own heap block of exactly its length (not NUL-terminated, as the
 * AMQP bytes are), so a read past a field is an ASan report.
 *
 * Checked beyond memory safety: an accepted envelope has a canonical lowercase event id, an
 * object payload and a NUL-terminated type; a rejected one has a NUL-terminated detail and no
 * payload; the code is one of the contract's. */
#include <ctype.h>

#include "envelope.h"
#include "fuzz_common.h"
#include "uuid.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static idemp_str_t field(fz_t *f, bool present, char **keep)
{
    size_t len;
    const uint8_t *p = fz_field(f, &len);
    *keep = NULL;
    if (!present)
        return (idemp_str_t){NULL, 0};
    *keep = fz_dup(p, len, 0);
    return (idemp_str_t){*keep, len};
}

static bool canonical(const char *id)
{
    if (strlen(id) != 36)
        return false;
    for (int i = 0; i < 36; i++) {
        char ch = id[i];
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (ch != '-')
                return false;
        } else if (!(isdigit((unsigned char)ch) || (ch >= 'a' && ch <= 'f'))) {
            return false;
        }
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    uint8_t flags = fz_u8(&f), limits = fz_u8(&f);
    idemp_envelope_in_t in;
    memset(&in, 0, sizeof in);
    in.has_timestamp = flags & 0x80;
    in.timestamp = fz_u64(&f);
    int64_t now_ms = (int64_t)fz_u64(&f);
    if (limits & 0x40)
        now_ms = 1790000000000LL; /* a plausible clock most of the time */
    in.has_seq = flags & 0x40;
    in.seq = (int64_t)fz_u64(&f);
    char *k[7];
    in.message_id = field(&f, flags & 0x01, &k[0]);
    in.hdr_event_id = field(&f, flags & 0x02, &k[1]);
    in.hdr_event_id_bad_kind = flags & 0x04;
    in.type = field(&f, flags & 0x08, &k[2]);
    in.hdr_event_type = field(&f, flags & 0x10, &k[3]);
    in.routing_key = field(&f, true, &k[4]);
    in.hdr_subscription_id = field(&f, flags & 0x20, &k[5]);
    /* the body: read (a heap block of its exact length) or not read (oversized) */
    k[6] = NULL;
    if (!(limits & 0x80)) {
        k[6] = fz_dup(f.p, f.n, 0);
        in.body = k[6];
        in.body_len = f.n;
    }
    in.body_size = (limits & 0x80) ? (uint64_t)f.n << (limits & 0x1f) : f.n;
    static const int64_t max_bytes[4] = {1048576, 64, 0, INT64_MAX};
    int64_t max = max_bytes[limits & 3];

    idemp_envelope_t out;
    size_t dsz = 1 + (flags & 0x80 ? 600 : (limits & 0x1f) * 3);
    char *detail = malloc(dsz);
    idemp_dl_code code = idemp_envelope_parse(&in, max, now_ms, &out, detail, dsz);

    FZ_CHECK(code >= IDEMP_DL_NONE && code < IDEMP_DL_COUNT, "code %d", (int)code);
    FZ_CHECK(memchr(detail, '\0', dsz) != NULL, "detail not terminated");
    if (code == IDEMP_DL_NONE) {
        FZ_CHECK(json_is_object(out.payload), "payload not an object");
        FZ_CHECK(canonical(out.event_id), "event id '%s' not canonical", out.event_id);
        FZ_CHECK(memchr(out.event_type, '\0', sizeof out.event_type) != NULL, "type unterminated");
        FZ_CHECK(out.subscription_id[0] == '\0' || canonical(out.subscription_id),
                 "subscription '%s' not canonical", out.subscription_id);
        /* the id came from message_id, else from the header, normalised */
        idemp_str_t src =
            (in.message_id.ptr && in.message_id.len) ? in.message_id : in.hdr_event_id;
        char want[37];
        FZ_CHECK(idemp_uuid_normalize(src.ptr, src.len, want) && strcmp(want, out.event_id) == 0,
                 "event id %s is not the normalised source", out.event_id);
        if (out.has_timestamp)
            FZ_CHECK(out.timestamp_s >= 0 && out.timestamp_s <= now_ms / 1000 + 86400,
                     "unusable timestamp %lld kept", (long long)out.timestamp_s);
        json_decref(out.payload);
    } else {
        FZ_CHECK(out.payload == NULL, "payload set on rejection");
        FZ_CHECK(dsz < 2 || detail[0] != '\0' || code == IDEMP_DL_NONE, "empty detail for %s",
                 idemp_dl_code_name(code));
    }
    /* the timestamp rule on its own */
    int64_t ts = -1;
    if (idemp_envelope_timestamp(in.timestamp, now_ms, &ts))
        FZ_CHECK(ts >= 0, "negative timestamp %lld usable", (long long)ts);
    free(detail);
    for (int i = 0; i < 7; i++)
        free(k[i]);
    return 0;
}
