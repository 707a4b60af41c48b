/* test_uuid.c - UUID normalisation (src/util/uuid.c) against what PostgreSQL 15's uuid_in accepts.
 * Every case below was checked with `SELECT '<input>'::uuid` on a PostgreSQL 15 server. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <idem/uuid.h>

#include "rmq.h"
#include "uuid.h"

#define CANON "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"

/* Accepted by PostgreSQL, all equal to CANON. */
static const char *const accepted[] = {
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",      "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
    "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",    "a0eebc999c0b4ef8bb6d6bb9bd380a11",
    "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11",   "{a0eebc99-9c0b4ef8-bb6d6bb9-bd380a11}",
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd38-0a11",     "a0eebc999c0b4ef8bb6d6bb9bd38-0a11",
    "{a0eebc999c0b4ef8bb6d6bb9bd380a11}",        "A0EEBC99-9c0b-4EF8-bb6d-6BB9BD380A11",
    "{A0EE-BC99-9C0B-4EF8-BB6D-6BB9-BD38-0A11}",
};

/* Rejected by PostgreSQL ("invalid input syntax for type uuid"). */
static const char *const rejected[] = {
    "",
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",     /* 31 digits */
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111",   /* 33 digits */
    "a0eebc99",                                /* far too short */
    "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",    /* not hex */
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1z",    /* not hex, last */
    "a0eebc99_9c0b_4ef8_bb6d_6bb9bd380a11",    /* wrong separator */
    "-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",   /* leading hyphen */
    "a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11",   /* double hyphen */
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-",   /* trailing hyphen */
    "a0e-ebc99-9c0b-4ef8-bb6d-6bb9bd380a11",   /* hyphen after 3 digits */
    "a0-eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",   /* hyphen after 2 digits */
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1-1",   /* hyphen after 31 digits */
    "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",   /* unbalanced brace */
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",   /* unbalanced brace */
    "{-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}", /* leading hyphen inside braces */
    "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-}", /* trailing hyphen inside braces */
    "{}",
    "{",
    "}",
    "-",
    "{{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}}",
    "a0eebc999c0b4ef8bb6d6bb9bd380a11{}",
    " a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", /* no whitespace trimming */
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11 ",
    "0xa0eebc999c0b4ef8bb6d6bb9bd380a11",
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
};

static void test_private_accepts(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) {
        char out[37];
        memset(out, 'Z', sizeof out);
        if (!idemp_uuid_normalize(accepted[i], strlen(accepted[i]), out))
            fail_msg("idemp_uuid_normalize rejects '%s', PostgreSQL accepts it", accepted[i]);
        assert_string_equal(out, CANON);
    }
}

static void test_public_accepts(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) {
        char out[37];
        memset(out, 'Z', sizeof out);
        if (!idem_uuid_normalize(accepted[i], out))
            fail_msg("idem_uuid_normalize rejects '%s', PostgreSQL accepts it", accepted[i]);
        assert_string_equal(out, CANON);
    }
}

static void test_private_rejects(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof rejected / sizeof rejected[0]; i++) {
        char out[37];
        if (idemp_uuid_normalize(rejected[i], strlen(rejected[i]), out))
            fail_msg("idemp_uuid_normalize accepts '%s' as %.36s, PostgreSQL rejects it",
                     rejected[i], out);
    }
}

static void test_public_rejects(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof rejected / sizeof rejected[0]; i++) {
        char out[37];
        if (idem_uuid_normalize(rejected[i], out))
            fail_msg("idem_uuid_normalize accepts '%s' as %.36s, PostgreSQL rejects it",
                     rejected[i], out);
    }
    char out[37];
    assert_false(idem_uuid_normalize(NULL, out));
}

static void test_every_hex_digit(void **state)
{
    (void)state;
    char out[37];
    assert_true(idem_uuid_normalize("0123456789abcdefABCDEF0123456789", out));
    assert_string_equal(out, "01234567-89ab-cdef-abcd-ef0123456789");
    assert_true(idem_uuid_normalize("FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF", out));
    assert_string_equal(out, "ffffffff-ffff-ffff-ffff-ffffffffffff");
    assert_true(idem_uuid_normalize("00000000-0000-0000-0000-000000000000", out));
    assert_string_equal(out, "00000000-0000-0000-0000-000000000000");
}

/* Every placement of one hyphen after a group of four digits is accepted; every other
 * placement is not. */
static void test_hyphen_positions(void **state)
{
    (void)state;
    const char *digits = "a0eebc999c0b4ef8bb6d6bb9bd380a11";
    for (int at = 0; at <= 32; at++) {
        char in[80], out[37];
        snprintf(in, sizeof in, "%.*s-%s", at, digits, digits + at);
        bool want = at > 0 && at < 32 && at % 4 == 0;
        bool got = idem_uuid_normalize(in, out);
        if (got != want)
            fail_msg("'%s': got %s, PostgreSQL %s it", in, got ? "accepted" : "rejected",
                     want ? "accepts" : "rejects");
        if (got)
            assert_string_equal(out, CANON);
    }
}

static void test_length_bounded(void **state)
{
    (void)state;
    char out[37];
    /* only len bytes count: the valid id followed by junk */
    const char *s = CANON "trailing junk";
    assert_true(idemp_uuid_normalize(s, 36, out));
    assert_string_equal(out, CANON);
    /* one byte short */
    assert_false(idemp_uuid_normalize(s, 35, out));
    /* braces: the closing brace must be the last byte within len */
    const char *b = "{" CANON "}xyz";
    assert_true(idemp_uuid_normalize(b, 38, out));
    assert_string_equal(out, CANON);
    assert_false(idemp_uuid_normalize(b, 39, out));
    assert_false(idemp_uuid_normalize(b, 37, out));
    /* an embedded NUL is not a digit */
    const char nul[] = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd38\0a11";
    assert_false(idemp_uuid_normalize(nul, sizeof nul - 1, out));
    /* zero length */
    assert_false(idemp_uuid_normalize("", 0, out));
    assert_false(idemp_uuid_normalize(CANON, 0, out));
}

static void test_output_terminated(void **state)
{
    (void)state;
    char out[40];
    memset(out, 'Z', sizeof out);
    assert_true(idem_uuid_normalize("{A0EEBC999C0B4EF8BB6D6BB9BD380A11}", out));
    assert_int_equal(out[36], '\0');
    assert_int_equal(out[37], 'Z'); /* nothing written past out[37] */
    assert_int_equal(strlen(out), 36);
}

static void test_shard(void **state)
{
    (void)state;
    /* md5("00000000-0000-0000-0000-000000000001") begins with bytes whose big-endian value mod
     * 1024 is 494; the same for the other form of the same id (it is normalised first) */
    assert_int_equal(idemp_amqp_shard("00000000-0000-0000-0000-000000000001"), 494);
    assert_int_equal(idemp_amqp_shard("6ba7b810-9dad-11d1-80b4-00c04fd430c8"), 720);
    assert_int_equal(idemp_amqp_shard("{6BA7B8109DAD11D180B400C04FD430C8}"), 720);
    assert_int_equal(idemp_amqp_shard("not a uuid"), -1);
    assert_int_equal(idemp_amqp_shard(NULL), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_private_accepts), cmocka_unit_test(test_public_accepts),
        cmocka_unit_test(test_private_rejects), cmocka_unit_test(test_public_rejects),
        cmocka_unit_test(test_every_hex_digit), cmocka_unit_test(test_hyphen_positions),
        cmocka_unit_test(test_length_bounded),  cmocka_unit_test(test_output_terminated),
        cmocka_unit_test(test_shard),
    };
    return cmocka_run_group_tests_name("uuid", tests, NULL, NULL);
}
