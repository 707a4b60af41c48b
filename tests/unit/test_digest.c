/* test_digest.c - the ledger's content digest (src/wire/digest.c): its canonical form, pinned
 * against SHA-256 of the documented bytes, and which differences change it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <openssl/evp.h>

#include "digest.h"

#define SUB "6f1e2d3c-4b5a-4968-8776-655443322110"
#define SUB2 "0b1a5e2f-3c4d-4e5f-8a9b-0c1d2e3f4a5b"

static void sha256_hex(const void *p, size_t n, char out[IDEMP_DIGEST_HEX])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    assert_int_equal(EVP_Digest(p, n, md, &len, EVP_sha256(), NULL), 1);
    for (unsigned int i = 0; i < len; i++)
        snprintf(out + 2 * i, 3, "%02x", md[i]);
}

static void digest_of(const char *type, const char *sub, const char *json,
                      char out[IDEMP_DIGEST_HEX])
{
    json_error_t e;
    json_t *doc = json_loads(json, JSON_REJECT_DUPLICATES, &e);
    if (doc == NULL)
        fail_msg("bad test JSON %s: %s", json, e.text);
    assert_true(idemp_digest_event(type, sub, doc, out));
    json_decref(doc);
    assert_int_equal(strlen(out), 64);
}

/* type NUL subscription NUL compact JSON with sorted keys, UTF-8 as is */
static void test_canonical_form(void **state)
{
    (void)state;
    static const char canon[] =
        "payment.failed\0" SUB "\0"
        "{\"a\":[1,2.5,\"\xc3\xa9\"],\"b\":{\"x\":null,\"y\":true},\"c\":1}";
    char want[IDEMP_DIGEST_HEX], got[IDEMP_DIGEST_HEX];
    sha256_hex(canon, sizeof canon - 1, want);
    digest_of("payment.failed", SUB,
              "{\"c\":1,\"b\":{\"y\":true,\"x\":null},\"a\":[1,2.5,\"\xc3\xa9\"]}", got);
    assert_string_equal(got, want);
    /* spacing, key order and escapes do not matter */
    digest_of("payment.failed", SUB,
              "  {\n \"b\" : { \"x\" : null , \"y\":true},\t\"a\":[1, 2.50, \"\\u00e9\"], \"c\":1}",
              got);
    assert_string_equal(got, want);
    /* no subscription: an empty field */
    static const char canon2[] = "t\0\0{}";
    sha256_hex(canon2, sizeof canon2 - 1, want);
    digest_of("t", "", "{}", got);
    assert_string_equal(got, want);
}

static void test_what_changes_it(void **state)
{
    (void)state;
    char base[IDEMP_DIGEST_HEX], d[IDEMP_DIGEST_HEX];
    digest_of("receipt.requested", SUB, "{\"amount_cents\":100,\"currency\":\"EUR\"}", base);
    digest_of("receipt.requested", SUB, "{\"currency\":\"EUR\",\"amount_cents\":100}", d);
    assert_string_equal(d, base);
    digest_of("invoice.paid", SUB, "{\"amount_cents\":100,\"currency\":\"EUR\"}", d);
    assert_string_not_equal(d, base);
    digest_of("receipt.requested", SUB2, "{\"amount_cents\":100,\"currency\":\"EUR\"}", d);
    assert_string_not_equal(d, base);
    digest_of("receipt.requested", "", "{\"amount_cents\":100,\"currency\":\"EUR\"}", d);
    assert_string_not_equal(d, base);
    digest_of("receipt.requested", SUB, "{\"amount_cents\":101,\"currency\":\"EUR\"}", d);
    assert_string_not_equal(d, base);
    /* an integer and a real are different values (as in jsonb's text form) */
    digest_of("receipt.requested", SUB, "{\"amount_cents\":100.0,\"currency\":\"EUR\"}", d);
    assert_string_not_equal(d, base);
    digest_of("receipt.requested", SUB, "{\"amount_cents\":100,\"currency\":\"EUR\",\"x\":1}", d);
    assert_string_not_equal(d, base);
    /* the field boundaries cannot shift: the type carries no NUL, the separators are fixed */
    digest_of("a", "b", "{}", base);
    digest_of("ab", "", "{}", d);
    assert_string_not_equal(d, base);
}

/* A payload whose canonical form does not fit the stack buffer is streamed: the same digest as
 * SHA-256 of the documented bytes. */
static void test_large_payload(void **state)
{
    (void)state;
    static char big[20000], json[20100], canon[20200];
    memset(big, 'z', sizeof big - 1);
    snprintf(json, sizeof json, "{\"b\":\"%s\",\"a\":1}", big);
    int n = snprintf(canon, sizeof canon, "t%c%s%c{\"a\":1,\"b\":\"%s\"}", 0, SUB, 0, big);
    char want[IDEMP_DIGEST_HEX], got[IDEMP_DIGEST_HEX];
    sha256_hex(canon, (size_t)n, want);
    digest_of("t", SUB, json, got);
    assert_string_equal(got, want);
    /* and around the buffer's edge */
    for (size_t len = 4000; len < 4100; len += 7) {
        big[len] = '\0';
        snprintf(json, sizeof json, "{\"b\":\"%s\"}", big);
        n = snprintf(canon, sizeof canon, "t%c%s%c{\"b\":\"%s\"}", 0, SUB, 0, big);
        sha256_hex(canon, (size_t)n, want);
        digest_of("t", SUB, json, got);
        assert_string_equal(got, want);
        big[len] = 'z';
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_canonical_form),
        cmocka_unit_test(test_what_changes_it),
        cmocka_unit_test(test_large_payload),
    };
    return cmocka_run_group_tests_name("digest", tests, NULL, NULL);
}
