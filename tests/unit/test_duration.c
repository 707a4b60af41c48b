/* test_duration.c - idem_duration_parse (src/util/duration.c): units, ms, missing unit, signs,
 * garbage, overflow. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include <idem/duration.h>
#include <idem/error.h>

#define SENTINEL ((int64_t)-777)

/* Parses s and checks it succeeds with want milliseconds. */
static void ok(const char *s, bool allow_ms, int64_t want)
{
    int64_t ms = SENTINEL;
    int rc = idem_duration_parse(s, allow_ms, &ms);
    if (rc != IDEM_OK || ms != want)
        fail_msg("'%s' (allow_ms=%d): rc %d, %lld ms; want 0, %lld ms", s, (int)allow_ms, rc,
                 (long long)ms, (long long)want);
}

/* Parses s and checks it is IDEM_ERR_INVALID and leaves *out untouched. */
static void bad(const char *s, bool allow_ms)
{
    int64_t ms = SENTINEL;
    int rc = idem_duration_parse(s, allow_ms, &ms);
    if (rc != IDEM_ERR_INVALID || ms != SENTINEL)
        fail_msg("'%s' (allow_ms=%d): rc %d, %lld ms; want IDEM_ERR_INVALID, untouched",
                 s ? s : "(null)", (int)allow_ms, rc, (long long)ms);
}

static void test_units(void **state)
{
    (void)state;
    ok("90s", false, 90 * 1000LL);
    ok("15m", false, 15 * 60 * 1000LL);
    ok("2h", false, 2 * 3600 * 1000LL);
    ok("7d", false, 7 * 86400 * 1000LL);
    ok("30d", false, 30 * 86400 * 1000LL);
    ok("1s", false, 1000);
    ok("0s", false, 0);
    ok("0d", false, 0);
    ok("007s", false, 7000);
    /* the same with ms allowed: s, m, h, d keep their meaning */
    ok("90s", true, 90 * 1000LL);
    ok("15m", true, 15 * 60 * 1000LL);
    ok("2h", true, 2 * 3600 * 1000LL);
    ok("7d", true, 7 * 86400 * 1000LL);
}

static void test_ms(void **state)
{
    (void)state;
    ok("200ms", true, 200);
    ok("0ms", true, 0);
    ok("1500ms", true, 1500);
    bad("200ms", false);
    bad("1ms", false);
}

static void test_missing_unit(void **state)
{
    (void)state;
    bad("30", false);
    bad("30", true);
    bad("0", false);
}

static void test_garbage(void **state)
{
    (void)state;
    bad("", false);
    bad("", true);
    bad(NULL, false);
    bad("-5s", false);
    bad("-5s", true);
    bad("+5s", false);
    bad("5x", false);
    bad("5x", true);
    bad("s", false);
    bad("ms", true);
    bad(" 5s", false);
    bad("5s ", false);
    bad("5 s", false);
    bad("5S", false);
    bad("5sec", false);
    bad("5min", false);
    bad("5ss", false);
    bad("5msx", true);
    bad("1.5s", false);
    bad("5s5", false);
    bad("0x10s", false);
}

static void test_overflow(void **state)
{
    (void)state;
    bad("99999999999999999999d", false);
    bad("99999999999999999999s", false);
    bad("99999999999999999999ms", true);
    bad("9223372036854775808ms", true); /* INT64_MAX + 1 */
    /* fits as a number but not once multiplied */
    bad("9223372036854776s", false);
    bad("106751991168d", false);
    bad("2562047788016h", false);
    bad("153722867280913m", false);
    /* the largest counts that fit in int64 milliseconds */
    ok("9223372036854775s", true, 9223372036854775LL * 1000);
    ok("106751991167d", false, 106751991167LL * 86400 * 1000);
    ok("2562047788015h", false, 2562047788015LL * 3600 * 1000);
    ok("153722867280912m", false, 153722867280912LL * 60 * 1000);
}

/* The whole int64 range of milliseconds is usable: only a value beyond INT64_MAX overflows. */
static void test_int64_boundary(void **state)
{
    (void)state;
    ok("9223372036854775807ms", true, INT64_MAX);
    ok("9223372036854775800ms", true, INT64_MAX - 7);
    ok("9223372036854775799ms", true, INT64_MAX - 8);
    bad("9223372036854775808ms", true);
    bad("9223372036854775810ms", true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_units),        cmocka_unit_test(test_ms),
        cmocka_unit_test(test_missing_unit), cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_overflow),     cmocka_unit_test(test_int64_boundary),
    };
    return cmocka_run_group_tests_name("duration", tests, NULL, NULL);
}
