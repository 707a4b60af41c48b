/* test_envelope.c - delivery validation (src/wire/envelope.c): every dead-letter code it produces,
 * where the event id and type come from, UUID normalisation, subscription_id, code names. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "envelope.h"

#define ID "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
#define ID2 "0b1a5e2f-3c4d-4e5f-8a9b-0c1d2e3f4a5b"
#define SUB "6f1e2d3c-4b5a-4968-8776-655443322110"
#define BODY "{\"invoice_id\":\"" ID2 "\",\"subscription_id\":\"" SUB "\",\"amount_cents\":100}"

#define MAX_BYTES 1048576
#define NOW_MS 1700000000000LL          /* 2023-11-14T22:13:20Z */
#define WINDOW_MS (30LL * 86400 * 1000) /* 30d */

static idemp_str_t S(const char *s)
{
    return (idemp_str_t){s, s ? strlen(s) : 0};
}

/* A valid delivery as the relay publishes it. */
static idemp_envelope_in_t good(void)
{
    idemp_envelope_in_t in;
    memset(&in, 0, sizeof in);
    in.message_id = S(ID);
    in.hdr_event_id = S(ID);
    in.type = S("invoice.paid");
    in.hdr_event_type = S("invoice.paid");
    in.routing_key = S("invoice.paid");
    in.has_timestamp = true;
    in.timestamp = NOW_MS / 1000 - 60;
    in.body = BODY;
    in.body_len = strlen(BODY);
    return in;
}

static char detail[512];

static idemp_dl_code parse_with(const idemp_envelope_in_t *in, int64_t max, int64_t window,
                                idemp_envelope_t *out)
{
    memset(detail, 'x', sizeof detail - 1);
    detail[sizeof detail - 1] = '\0';
    (void)window; /* the age is decided by the database, in the claim */
    return idemp_envelope_parse(in, max, NOW_MS, out, detail, sizeof detail);
}

static idemp_dl_code parse(const idemp_envelope_in_t *in, idemp_envelope_t *out)
{
    return parse_with(in, MAX_BYTES, WINDOW_MS, out);
}

/* Expects in to be dead-lettered with code, a non-empty detail and no payload. */
static void expect_dl(const idemp_envelope_in_t *in, idemp_dl_code code)
{
    idemp_envelope_t out;
    memset(&out, 0x5a, sizeof out);
    idemp_dl_code got = parse(in, &out);
    if (got != code)
        fail_msg("got %s (%d), want %s (%d); detail: %s", idemp_dl_code_name(got), (int)got,
                 idemp_dl_code_name(code), (int)code, detail);
    assert_null(out.payload);
    assert_true(detail[0] != '\0');
    assert_null(strchr(detail, '\n'));
}

/* Expects in to be accepted; returns out (caller json_decrefs out->payload). */
static idemp_envelope_t expect_ok(const idemp_envelope_in_t *in)
{
    idemp_envelope_t out;
    idemp_dl_code got = parse(in, &out);
    if (got != IDEMP_DL_NONE)
        fail_msg("got %s (%d), want acceptance; detail: %s", idemp_dl_code_name(got), (int)got,
                 detail);
    assert_non_null(out.payload);
    assert_true(json_is_object(out.payload));
    return out;
}

static void test_valid(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    idemp_envelope_t out = expect_ok(&in);
    assert_string_equal(out.event_id, ID);
    assert_string_equal(out.event_type, "invoice.paid");
    assert_string_equal(out.subscription_id, SUB);
    assert_int_equal(json_integer_value(json_object_get(out.payload, "amount_cents")), 100);
    assert_string_equal(json_string_value(json_object_get(out.payload, "invoice_id")), ID2);
    assert_int_equal(out.payload->refcount, 1);
    json_decref(out.payload);
}

/* ---- oversized ---- */

static void test_oversized(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    int64_t len = (int64_t)in.body_len;
    idemp_envelope_t out;

    memset(&out, 0x5a, sizeof out);
    assert_int_equal(parse_with(&in, len - 1, WINDOW_MS, &out), IDEMP_DL_OVERSIZED);
    assert_null(out.payload);
    assert_non_null(strstr(detail, "limit"));

    /* exactly the limit is accepted */
    assert_int_equal(parse_with(&in, len, WINDOW_MS, &out), IDEMP_DL_NONE);
    assert_non_null(out.payload);
    json_decref(out.payload);

    /* the size check comes before anything else: bad id and JSON do not matter */
    in.message_id = S("nope");
    in.hdr_event_id = S(NULL);
    in.body = "[[[";
    in.body_len = 3;
    assert_int_equal(parse_with(&in, 2, WINDOW_MS, &out), IDEMP_DL_OVERSIZED);
    assert_null(out.payload);

    /* an empty body against a zero limit is not oversized (it is malformed JSON) */
    in = good();
    in.body = "";
    in.body_len = 0;
    assert_int_equal(parse_with(&in, 0, WINDOW_MS, &out), IDEMP_DL_MALFORMED_JSON);
}

/* ---- event id ---- */

static void test_missing_event_id(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    in.message_id = S(NULL);
    in.hdr_event_id = S(NULL);
    expect_dl(&in, IDEMP_DL_MISSING_EVENT_ID);

    /* empty strings count as absent */
    in.message_id = S("");
    in.hdr_event_id = S("");
    expect_dl(&in, IDEMP_DL_MISSING_EVENT_ID);

    in.message_id = (idemp_str_t){ID, 0};
    in.hdr_event_id = (idemp_str_t){NULL, 0};
    expect_dl(&in, IDEMP_DL_MISSING_EVENT_ID);
}

static void test_invalid_event_id(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "not-a-uuid",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",   /* too short */
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111", /* too long */
        "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",  /* not hex */
        "-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "42",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        idemp_envelope_in_t in = good();
        in.message_id = S(bad[i]);
        expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);
        assert_non_null(strstr(detail, "message_id"));
        /* the same id in the header only */
        in.message_id = S(NULL);
        in.hdr_event_id = S(bad[i]);
        expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);
        assert_non_null(strstr(detail, "event_id header"));
    }

    /* a bad message_id is not rescued by a good header */
    idemp_envelope_in_t in = good();
    in.message_id = S("bogus");
    in.hdr_event_id = S(ID);
    expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);

    /* a length-bounded field: the valid id followed by junk outside len is fine, but the
     * same id with one byte cut is not */
    in = good();
    in.message_id = (idemp_str_t){ID, strlen(ID) - 1};
    expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);

    /* control bytes in the id do not reach the detail */
    in = good();
    in.message_id = S("bad\nid\x01");
    expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);
    assert_null(strchr(detail, '\x01'));
}

static void test_event_id_header_not_string(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    in.message_id = S(NULL);
    in.hdr_event_id = S(NULL);
    in.hdr_event_id_bad_kind = true;
    expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);
    assert_non_null(strstr(detail, "not a string"));

    /* message_id wins: the header is not consulted */
    in.message_id = S(ID2);
    idemp_envelope_t out = expect_ok(&in);
    assert_string_equal(out.event_id, ID2);
    json_decref(out.payload);
}

static void test_event_id_source(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    in.message_id = S(ID);
    in.hdr_event_id = S(ID2);
    idemp_envelope_t out = expect_ok(&in);
    assert_string_equal(out.event_id, ID); /* message_id first */
    json_decref(out.payload);

    in.message_id = S(NULL);
    out = expect_ok(&in);
    assert_string_equal(out.event_id, ID2); /* else the header */
    json_decref(out.payload);

    in.message_id = S("");
    out = expect_ok(&in);
    assert_string_equal(out.event_id, ID2); /* an empty message_id is absent */
    json_decref(out.payload);

    /* a longer buffer: only len bytes are the id */
    char buf[64];
    snprintf(buf, sizeof buf, "%sGARBAGE", ID);
    in.message_id = (idemp_str_t){buf, strlen(ID)};
    out = expect_ok(&in);
    assert_string_equal(out.event_id, ID);
    json_decref(out.payload);
}

static void test_event_id_normalised(void **state)
{
    (void)state;
    static const char *const forms[] = {
        "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",    "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
        "a0eebc999c0b4ef8bb6d6bb9bd380a11",        "{A0EEBC999C0B4EF8BB6D6BB9BD380A11}",
        "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11", "A0eeBC99-9c0b4ef8-bb6d6bb9-bd380A11",
    };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        idemp_envelope_in_t in = good();
        in.message_id = S(forms[i]);
        idemp_envelope_t out = expect_ok(&in);
        assert_string_equal(out.event_id, ID);
        json_decref(out.payload);

        in.message_id = S(NULL);
        in.hdr_event_id = S(forms[i]);
        out = expect_ok(&in);
        assert_string_equal(out.event_id, ID);
        json_decref(out.payload);
    }
}

/* ---- event type ---- */

static void test_event_type_source(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    in.type = S("from.type");
    in.hdr_event_type = S("from.header");
    in.routing_key = S("from.key");
    idemp_envelope_t out = expect_ok(&in);
    assert_string_equal(out.event_type, "from.type");
    json_decref(out.payload);

    in.type = S(NULL);
    out = expect_ok(&in);
    assert_string_equal(out.event_type, "from.header");
    json_decref(out.payload);

    in.type = S(""); /* empty counts as absent */
    out = expect_ok(&in);
    assert_string_equal(out.event_type, "from.header");
    json_decref(out.payload);

    in.hdr_event_type = S(NULL);
    out = expect_ok(&in);
    assert_string_equal(out.event_type, "from.key");
    json_decref(out.payload);

    in.hdr_event_type = S("");
    out = expect_ok(&in);
    assert_string_equal(out.event_type, "from.key");
    json_decref(out.payload);

    /* none at all: empty type, left for the caller to dead-letter as unknown_type */
    in.routing_key = S(NULL);
    out = expect_ok(&in);
    assert_string_equal(out.event_type, "");
    json_decref(out.payload);

    /* length-bounded, not NUL-terminated */
    in.type = (idemp_str_t){"payment.failedXYZ", strlen("payment.failed")};
    out = expect_ok(&in);
    assert_string_equal(out.event_type, "payment.failed");
    json_decref(out.payload);
}

static void test_event_type_too_long(void **state)
{
    (void)state;
    char longtype[300];
    memset(longtype, 't', sizeof longtype);
    idemp_envelope_in_t in = good();

    in.type = (idemp_str_t){longtype, 256};
    expect_dl(&in, IDEMP_DL_UNKNOWN_TYPE);

    in.type = (idemp_str_t){longtype, 255}; /* fits event_type[256] */
    idemp_envelope_t out = expect_ok(&in);
    assert_int_equal(strlen(out.event_type), 255);
    json_decref(out.payload);
}

/* ---- body ---- */

static void test_malformed_json(void **state)
{
    (void)state;
    static const char *const bodies[] = {
        "",
        "{",
        "{\"a\":}",
        "not json",
        "{\"a\":1}garbage",
        "{\"a\":1,\"a\":2}", /* duplicate keys are rejected */
        "{'a':1}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        idemp_envelope_in_t in = good();
        in.body = bodies[i];
        in.body_len = strlen(bodies[i]);
        expect_dl(&in, IDEMP_DL_MALFORMED_JSON);
    }

    /* a NULL body is an empty one */
    idemp_envelope_in_t in = good();
    in.body = NULL;
    in.body_len = 0;
    expect_dl(&in, IDEMP_DL_MALFORMED_JSON);

    /* only body_len bytes are parsed */
    in = good();
    in.body = "{\"a\":1}";
    in.body_len = 5;
    expect_dl(&in, IDEMP_DL_MALFORMED_JSON);
}

static void test_invalid_payload(void **state)
{
    (void)state;
    static const struct {
        const char *body, *word;
    } cases[] = {
        {"[]", "array"},    {"[1,2,3]", "array"}, {"\"text\"", "string"}, {"42", "number"},
        {"-1.5", "number"}, {"true", "literal"},  {"null", "literal"},    {"false", "literal"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        idemp_envelope_in_t in = good();
        in.body = cases[i].body;
        in.body_len = strlen(cases[i].body);
        expect_dl(&in, IDEMP_DL_INVALID_PAYLOAD);
        if (strstr(detail, cases[i].word) == NULL)
            fail_msg("body %s: detail '%s' does not say %s", cases[i].body, detail, cases[i].word);
    }

    /* an empty object is an object: what it lacks is the handler's business */
    idemp_envelope_in_t in = good();
    in.body = "{}";
    in.body_len = 2;
    idemp_envelope_t out = expect_ok(&in);
    assert_int_equal(json_object_size(out.payload), 0);
    assert_string_equal(out.subscription_id, "");
    json_decref(out.payload);
}

/* ---- timestamps, order key, seq ---- */

static void test_timestamp(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    idemp_envelope_t out;
    static const struct {
        uint64_t raw;
        bool usable;
    } cases[] = {
        {0, true},                            /* the epoch: usable (and very old) */
        {NOW_MS / 1000 - 40LL * 86400, true}, /* older than any window: the claim decides */
        {NOW_MS / 1000 + 3600, true},         /* an hour ahead: clock skew */
        {NOW_MS / 1000 + 86400, true},        /* exactly a day ahead */
        {NOW_MS / 1000 + 86401, false},       /* more than a day ahead */
        {NOW_MS, false},                      /* milliseconds by mistake */
        {NOW_MS * 1000000ULL, false},         /* nanoseconds by mistake */
        {1ULL << 63, false},                  /* negative as a signed number */
        {UINT64_MAX, false},                  /* -1 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        in.has_timestamp = true;
        in.timestamp = cases[i].raw;
        out = expect_ok(&in);
        if (out.has_timestamp != cases[i].usable)
            fail_msg("timestamp %llu: usable %d, want %d", (unsigned long long)cases[i].raw,
                     out.has_timestamp, cases[i].usable);
        if (cases[i].usable)
            assert_int_equal(out.timestamp_s, (int64_t)cases[i].raw);
        json_decref(out.payload);
    }
    in.has_timestamp = false;
    in.timestamp = NOW_MS / 1000;
    out = expect_ok(&in);
    assert_false(out.has_timestamp);
    json_decref(out.payload);
}

static void test_order_key_and_seq(void **state)
{
    (void)state;
    idemp_envelope_in_t in = good();
    /* the header names the subscription, whatever the payload says */
    in.hdr_subscription_id = S("{0B1A5E2F-3C4D-4E5F-8A9B-0C1D2E3F4A5B}");
    in.has_seq = true;
    in.seq = 42;
    idemp_envelope_t out = expect_ok(&in);
    assert_string_equal(out.subscription_id, ID2);
    assert_true(out.has_seq);
    assert_int_equal(out.seq, 42);
    json_decref(out.payload);
    /* a header that is not a UUID falls back to the payload's */
    in.hdr_subscription_id = S("nope");
    in.has_seq = false;
    out = expect_ok(&in);
    assert_string_equal(out.subscription_id, SUB);
    assert_false(out.has_seq);
    json_decref(out.payload);
}

static void test_oversized_unread(void **state)
{
    (void)state;
    /* a body too large to read comes without bytes, only its declared size */
    idemp_envelope_in_t in = good();
    in.body = NULL;
    in.body_len = 0;
    in.body_size = 64ULL << 20;
    expect_dl(&in, IDEMP_DL_OVERSIZED);
    assert_non_null(strstr(detail, "67108864"));
}

static void test_check_order(void **state)
{
    (void)state;
    /* an invalid id is reported before a broken body */
    idemp_envelope_in_t in = good();
    in.message_id = S("bogus");
    in.body = "{";
    in.body_len = 1;
    expect_dl(&in, IDEMP_DL_INVALID_EVENT_ID);

    /* a missing id before a broken body */
    in.message_id = S(NULL);
    in.hdr_event_id = S(NULL);
    expect_dl(&in, IDEMP_DL_MISSING_EVENT_ID);

    /* a non-object body, whatever the timestamp */
    in = good();
    in.timestamp = 0;
    in.body = "[]";
    in.body_len = 2;
    expect_dl(&in, IDEMP_DL_INVALID_PAYLOAD);
}

/* ---- subscription_id ---- */

static void test_subscription_id(void **state)
{
    (void)state;
    static const struct {
        const char *body, *want;
    } cases[] = {
        {"{\"subscription_id\":\"" SUB "\"}", SUB},
        {"{\"subscription_id\":\"6F1E2D3C-4B5A-4968-8776-655443322110\"}", SUB},
        {"{\"subscription_id\":\"{6f1e2d3c4b5a49688776655443322110}\"}", SUB},
        {"{\"subscription_id\":\"not-a-uuid\"}", ""},
        {"{\"subscription_id\":42}", ""},
        {"{\"subscription_id\":null}", ""},
        {"{\"subscription_id\":{\"id\":\"" SUB "\"}}", ""},
        {"{\"other\":\"" SUB "\"}", ""},
        {"{\"nested\":{\"subscription_id\":\"" SUB "\"}}", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        idemp_envelope_in_t in = good();
        in.body = cases[i].body;
        in.body_len = strlen(cases[i].body);
        idemp_envelope_t out = expect_ok(&in);
        if (strcmp(out.subscription_id, cases[i].want) != 0)
            fail_msg("body %s: subscription_id '%s', want '%s'", cases[i].body, out.subscription_id,
                     cases[i].want);
        json_decref(out.payload);
    }
}

/* ---- code names ---- */

static void test_code_names(void **state)
{
    (void)state;
    static const char *const want[IDEMP_DL_COUNT] = {
        [IDEMP_DL_NONE] = "",
        [IDEMP_DL_MALFORMED_JSON] = "malformed_json",
        [IDEMP_DL_MISSING_EVENT_ID] = "missing_event_id",
        [IDEMP_DL_INVALID_EVENT_ID] = "invalid_event_id",
        [IDEMP_DL_UNKNOWN_TYPE] = "unknown_type",
        [IDEMP_DL_OVERSIZED] = "oversized",
        [IDEMP_DL_INVALID_PAYLOAD] = "invalid_payload",
        [IDEMP_DL_HANDLER_REJECTED] = "handler_rejected",
        [IDEMP_DL_RETRIES_EXHAUSTED] = "retries_exhausted",
        [IDEMP_DL_UNTRUSTED] = "untrusted",
        [IDEMP_DL_CONFLICT] = "conflict",
        [IDEMP_DL_STALE] = "stale",
    };
    assert_int_equal(IDEMP_DL_COUNT, 12); /* the contract's eleven codes plus NONE */
    for (int c = 0; c < IDEMP_DL_COUNT; c++) {
        const char *name = idemp_dl_code_name((idemp_dl_code)c);
        assert_non_null(name);
        assert_non_null(want[c]);
        assert_string_equal(name, want[c]);
        if (c != IDEMP_DL_NONE) {
            assert_true(name[0] != '\0');
            for (int d = 1; d < c; d++) /* distinct */
                assert_string_not_equal(name, idemp_dl_code_name((idemp_dl_code)d));
        }
    }
    /* out of range: empty, never NULL */
    assert_string_equal(idemp_dl_code_name(IDEMP_DL_COUNT), "");
    assert_string_equal(idemp_dl_code_name((idemp_dl_code)99), "");
    assert_string_equal(idemp_dl_code_name((idemp_dl_code)-1), "");
}

/* --trusted-publisher: the user_id property must be exactly one of the names. */
static void test_trusted_publishers(void **state)
{
    (void)state;
    static const char *const list[] = {"idem-relay", "ops", NULL};
    static const char *const none[] = {NULL};
    char why[200];
    /* no list, or an empty one: every publisher, with or without user_id */
    assert_true(idemp_envelope_trusted(S(NULL), NULL, why, sizeof why));
    assert_true(idemp_envelope_trusted(S("anyone"), none, why, sizeof why));
    assert_true(idemp_envelope_trusted(S("idem-relay"), list, why, sizeof why));
    assert_true(idemp_envelope_trusted(S("ops"), list, why, sizeof why));
    /* absent */
    why[0] = '\0';
    assert_false(idemp_envelope_trusted(S(NULL), list, why, sizeof why));
    assert_non_null(strstr(why, "absent"));
    /* exact match only: no prefix, no longer name, no case folding, no NUL trick */
    const char *const wrong[] = {"idem", "idem-relay2", "IDEM-RELAY", "op", "", "ops "};
    for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
        why[0] = '\0';
        if (idemp_envelope_trusted(S(wrong[i]), list, why, sizeof why))
            fail_msg("user_id '%s' was trusted", wrong[i]);
        assert_non_null(strstr(why, "is not a trusted publisher"));
    }
    idemp_str_t nul = {"ops\0x", 5};
    assert_false(idemp_envelope_trusted(nul, list, why, sizeof why));
    idemp_str_t cut = {"opsx", 3}; /* not NUL-terminated: the length decides */
    assert_true(idemp_envelope_trusted(cut, list, why, sizeof why));
    /* the detail names the user, printable and bounded */
    assert_false(idemp_envelope_trusted(S("mallory"), list, why, sizeof why));
    assert_non_null(strstr(why, "'mallory'"));
    char longname[300];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    longname[5] = '\n';
    assert_false(idemp_envelope_trusted(S(longname), list, why, sizeof why));
    assert_null(strchr(why, '\n'));
    assert_true(strlen(why) < 150);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_oversized),
        cmocka_unit_test(test_missing_event_id),
        cmocka_unit_test(test_invalid_event_id),
        cmocka_unit_test(test_event_id_header_not_string),
        cmocka_unit_test(test_event_id_source),
        cmocka_unit_test(test_event_id_normalised),
        cmocka_unit_test(test_event_type_source),
        cmocka_unit_test(test_event_type_too_long),
        cmocka_unit_test(test_malformed_json),
        cmocka_unit_test(test_invalid_payload),
        cmocka_unit_test(test_timestamp),
        cmocka_unit_test(test_order_key_and_seq),
        cmocka_unit_test(test_oversized_unread),
        cmocka_unit_test(test_check_order),
        cmocka_unit_test(test_subscription_id),
        cmocka_unit_test(test_code_names),
        cmocka_unit_test(test_trusted_publishers),
    };
    return cmocka_run_group_tests_name("envelope", tests, NULL, NULL);
}
