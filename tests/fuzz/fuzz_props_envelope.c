/* fuzz_props_envelope.c - libFuzzer target for what the consumer does with the properties of a
 * delivery: decode them as librabbitmq does from a content header frame
 * (amqp_decode_properties), copy them as read_message() does, map them to envelope fields
 * (idemp_msg_envelope_in), validate (idemp_envelope_parse), render the headers for SQL handlers
 * (idemp_msg_headers_json), and build the dead-letter properties (dl_props).
 *
 * The two source files are included so that their static functions (clone_props, dl_props)
 * run exactly as compiled into the library; the link leaves out their objects.
 *
 * Input: a flags byte (bit 0: the body was too large to read), the routing key (1-byte
 * length), the encoded properties (2-byte length, AMQP basic class: property flags then fields),
 * the rest is the body.
 *
 * Checked beyond memory safety: the dead-letter properties always encode within a frame and
 * carry x-idem-error (the contract: dead-lettering never fails because of what the message
 * carries), and the headers rendered for SQL handlers are a JSON object. */
#include "../../src/adapters/rmq/rmq_deliver.c"
/* the frame_max a broker negotiated, as rmq_publish.c asks for it: chosen per input below */
static int fz_frame_max;
#define amqp_get_frame_max(conn) ((void)(conn), fz_frame_max)
#include "../../src/adapters/rmq/rmq_publish.c"
#undef amqp_get_frame_max

#include "envelope.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    uint8_t flags = fz_u8(&f);
    size_t rklen = fz_u8(&f);
    if (rklen > f.n)
        rklen = f.n;
    char *rk = fz_dup(f.p, rklen, 0);
    f.p += rklen;
    f.n -= rklen;
    size_t plen;
    const uint8_t *pp = fz_field(&f, &plen);
    char *enc = fz_dup(pp, plen, 0);

    amqp_pool_t wire;
    init_amqp_pool(&wire, 4096);
    void *decoded = NULL;
    amqp_bytes_t encoded = {plen, enc};
    int rc = amqp_decode_properties(AMQP_BASIC_CLASS, &wire, encoded, &decoded);
    if (rc < 0 || decoded == NULL) {
        empty_amqp_pool(&wire);
        free(enc);
        free(rk);
        return 0;
    }

    /* what read_message() builds */
    idemp_msg_t *m = calloc(1, sizeof *m);
    init_amqp_pool(&m->pool, 4096);
    m->tag = 1;
    rc = dup_bytes(&m->pool, (amqp_bytes_t){rklen, rk}, &m->routing_key);
    FZ_CHECK(rc == AMQP_STATUS_OK, "dup_bytes %d", rc);
    rc = clone_props(decoded, &m->props, &m->pool);
    FZ_CHECK(rc == AMQP_STATUS_OK, "clone_props %d", rc);
    empty_amqp_pool(&wire); /* the connection's buffers are reused: nothing may point there */
    free(enc);
    m->oversized = flags & 1;
    m->body_size = f.n;
    if (!m->oversized && f.n > 0) {
        m->body = amqp_bytes_malloc(f.n);
        memcpy(m->body.bytes, f.p, f.n);
    }

    idemp_envelope_in_t in;
    idemp_msg_envelope_in(m, &in);
    idemp_envelope_t env;
    char detail[512];
    idemp_dl_code code = idemp_envelope_parse(&in, (flags & 2) ? 16 : 1048576, 1790000000000LL,
                                              &env, detail, sizeof detail);
    if (code == IDEMP_DL_NONE) {
        json_decref(env.payload);
        code = IDEMP_DL_HANDLER_REJECTED; /* still dead-letter it below */
        snprintf(detail, sizeof detail, "a handler said no");
    }

    /* the other readers of a delivery */
    size_t hlen;
    (void)idemp_msg_header(m, "traceparent", &hlen);
    int64_t seq;
    (void)idemp_msg_header_int(m, "x-idem-requeued", &seq);
    uint64_t ts;
    (void)idemp_msg_timestamp(m, &ts);
    char *hj = idemp_msg_headers_json(m);
    FZ_CHECK(hj != NULL, "no headers JSON");
    {
        json_error_t jerr;
        json_t *o = json_loads(hj, 0, &jerr);
        FZ_CHECK(json_is_object(o), "headers JSON '%s' is not an object: %s", hj, jerr.text);
        json_decref(o);
        free(hj);
    }

    /* the dead-letter copy's properties, as idemp_amqp_dead_letter builds them; with flags bit
     * 2, as if the broker had negotiated AMQP's smallest frame_max (4096; RabbitMQ's frame_max
     * setting allows it), for a message whose properties fitted such a frame when they arrived */
    char reason[700];
    snprintf(reason, sizeof reason, "%s: %s", idemp_dl_code_name(code), detail);
    struct idemp_amqp out;
    memset(&out, 0, sizeof out);
    fz_frame_max = IDEMP_FRAME_MAX;
    if (flags & 4) {
        fz_frame_max = 4096;
        out.conn = (amqp_connection_state_t)&fz_frame_max; /* only its frame_max is asked */
        if (encoded_size(&out, &m->props) < 0) { /* could not have arrived in such a frame */
            idemp_msg_free(m);
            free(out.scratch);
            free(rk);
            return 0;
        }
    }
    int old = (m->props._flags & AMQP_BASIC_HEADERS_FLAG) ? m->props.headers.num_entries : 0;
    amqp_table_entry_t *entries = calloc((size_t)old + 4, sizeof *entries);
    char dropped[1024];
    amqp_basic_properties_t p;
    rc = dl_props(&out, m, reason, &p, entries, dropped, sizeof dropped);
    FZ_CHECK(rc == IDEM_OK, "dead-letter properties not encodable (%d) for %d headers", rc, old);
    FZ_CHECK(encoded_size(&out, &p) >= 0, "dead-letter properties over a frame");
    FZ_CHECK(!(p._flags & (AMQP_BASIC_EXPIRATION_FLAG | AMQP_BASIC_USER_ID_FLAG)),
             "expiration or user_id kept");
    bool has_err = false;
    for (int i = 0; i < p.headers.num_entries; i++)
        has_err |= key_is(&p.headers.entries[i], "x-idem-error");
    FZ_CHECK(has_err, "no x-idem-error");
    /* and it decodes again, as the broker and the next reader will */
    amqp_bytes_t buf = {(size_t)fz_frame_max, out.scratch};
    int n = amqp_encode_properties(AMQP_BASIC_CLASS, &p, buf);
    FZ_CHECK(n > 0, "encode %d", n);
    amqp_pool_t again;
    init_amqp_pool(&again, 4096);
    void *d2 = NULL;
    rc = amqp_decode_properties(AMQP_BASIC_CLASS, &again, (amqp_bytes_t){(size_t)n, out.scratch},
                                &d2);
    FZ_CHECK(rc >= 0, "the dead-letter properties do not decode again (%d)", rc);
    empty_amqp_pool(&again);

    free(entries);
    free(out.scratch);
    idemp_msg_free(m);
    free(rk);
    return 0;
}
