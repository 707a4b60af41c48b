/* test_envelope_suite.c - envelope validation as data (tests/unit/envelope/{valid,invalid}/CASE/):
 * each case's input.json describes a delivery (message_id, headers, type, routing key, timestamp,
 * body as text or body_b64, max_bytes) and expected.json the dead-letter code ("none" when it is
 * accepted) and, for accepted ones, what the envelope must hold. One driver reads every case. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "envelope.h"

#define SUITE "tests/unit/envelope"
#define NOW_MS 1700000000000LL

static idemp_str_t str(json_t *in, const char *key)
{
    json_t *v = json_object_get(in, key);
    return v ? (idemp_str_t){json_string_value(v), json_string_length(v)} : (idemp_str_t){NULL, 0};
}

static unsigned char *b64(const char *s, size_t *len)
{
    static const char *abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t n = strlen(s);
    unsigned char *out = malloc(n);
    size_t o = 0;
    unsigned v = 0;
    int bits = 0;
    for (size_t i = 0; i < n && s[i] != '='; i++) {
        const char *p = strchr(abc, s[i]);
        assert_non_null(p);
        v = (v << 6) | (unsigned)(p - abc);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (unsigned char)(v >> bits);
        }
    }
    *len = o;
    return out;
}

static void run_case(const char *dir)
{
    char path[600];
    json_error_t je;
    snprintf(path, sizeof path, "%s/input.json", dir);
    json_t *in = json_load_file(path, 0, &je);
    snprintf(path, sizeof path, "%s/expected.json", dir);
    json_t *want = json_load_file(path, 0, &je);
    if (in == NULL || want == NULL)
        fail_msg("%s: cannot read the case: %s", dir, je.text);

    idemp_envelope_in_t e;
    memset(&e, 0, sizeof e);
    e.message_id = str(in, "message_id");
    e.hdr_event_id = str(in, "hdr_event_id");
    e.hdr_event_id_bad_kind = json_is_true(json_object_get(in, "hdr_event_id_bad_kind"));
    e.type = str(in, "type");
    e.hdr_event_type = str(in, "hdr_event_type");
    e.routing_key = str(in, "routing_key");
    e.hdr_subscription_id = str(in, "hdr_subscription_id");
    json_t *seq = json_object_get(in, "seq"), *ts = json_object_get(in, "timestamp");
    e.has_seq = seq != NULL;
    e.seq = json_integer_value(seq);
    e.has_timestamp = ts != NULL;
    /* a string for values JSON integers cannot hold (2^63 and above) */
    e.timestamp = json_is_string(ts) ? strtoull(json_string_value(ts), NULL, 10)
                                     : (uint64_t)json_integer_value(ts);
    unsigned char *raw = NULL;
    if (json_object_get(in, "body_b64")) {
        raw = b64(json_string_value(json_object_get(in, "body_b64")), &e.body_len);
        e.body = (const char *)raw;
    } else if (json_object_get(in, "body")) {
        e.body = json_string_value(json_object_get(in, "body"));
        e.body_len = json_string_length(json_object_get(in, "body"));
    }
    e.body_size = json_object_get(in, "body_size")
                      ? (uint64_t)json_integer_value(json_object_get(in, "body_size"))
                      : e.body_len;
    int64_t max = json_object_get(in, "max_bytes")
                      ? json_integer_value(json_object_get(in, "max_bytes"))
                      : 1048576;

    idemp_envelope_t out;
    char detail[512];
    idemp_dl_code got = idemp_envelope_parse(&e, max, NOW_MS, &out, detail, sizeof detail);
    const char *code = json_string_value(json_object_get(want, "code"));
    const char *got_name = got == IDEMP_DL_NONE ? "none" : idemp_dl_code_name(got);
    if (strcmp(code, got_name) != 0)
        fail_msg("%s: got %s (%s), want %s", dir, got_name, detail, code);
    if (got == IDEMP_DL_NONE) {
        const char *k;
        json_t *v;
        json_object_foreach(want, k, v)
        {
            if (strcmp(k, "event_id") == 0)
                assert_string_equal(out.event_id, json_string_value(v));
            else if (strcmp(k, "event_type") == 0)
                assert_string_equal(out.event_type, json_string_value(v));
            else if (strcmp(k, "subscription_id") == 0)
                assert_string_equal(out.subscription_id, json_string_value(v));
            else if (strcmp(k, "seq") == 0)
                assert_true(out.has_seq && out.seq == json_integer_value(v));
            else if (strcmp(k, "timestamp") == 0 && json_is_null(v))
                assert_false(out.has_timestamp);
            else if (strcmp(k, "timestamp") == 0)
                assert_true(out.has_timestamp && out.timestamp_s == json_integer_value(v));
        }
        json_decref(out.payload);
    } else {
        assert_null(out.payload);
        assert_true(detail[0] != '\0' && strchr(detail, '\n') == NULL);
    }
    free(raw);
    json_decref(in);
    json_decref(want);
}

static int run_kind(const char *kind)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s/%s", SUITE, kind);
    DIR *d = opendir(dir);
    if (d == NULL)
        fail_msg("cannot open %s (run from the repository's root)", dir);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char cdir[300];
        snprintf(cdir, sizeof cdir, "%.40s/%.250s", dir, de->d_name);
        run_case(cdir);
        n++;
    }
    closedir(d);
    return n;
}

static void test_valid(void **state)
{
    (void)state;
    assert_true(run_kind("valid") >= 10);
}

static void test_invalid(void **state)
{
    (void)state;
    assert_true(run_kind("invalid") >= 15);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_invalid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
