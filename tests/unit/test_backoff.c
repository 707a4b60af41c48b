/* test_backoff.c - exponential backoff with a cap (src/util/backoff.c): the retry schedule of the
 * contract (1 s doubling to 30 s) and the reconnect schedule object. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "backoff.h"

static void test_contract_schedule(void **state)
{
    (void)state;
    /* retries wait 1 s doubling to 30 s */
    const int64_t want_s[] = {1, 2, 4, 8, 16, 30, 30};
    for (int n = 1; n <= 7; n++)
        assert_int_equal(idemp_backoff_delay(1000, 30000, n), want_s[n - 1] * 1000);
    /* and it stays capped far out */
    assert_int_equal(idemp_backoff_delay(1000, 30000, 8), 30000);
    assert_int_equal(idemp_backoff_delay(1000, 30000, 50), 30000);
    assert_int_equal(idemp_backoff_delay(1000, 30000, 1000), 30000);
}

static void test_non_positive_n(void **state)
{
    (void)state;
    assert_int_equal(idemp_backoff_delay(1000, 30000, 0), 0);
    assert_int_equal(idemp_backoff_delay(1000, 30000, -1), 0);
    assert_int_equal(idemp_backoff_delay(1000, 30000, INT32_MIN), 0);
}

static void test_other_bases(void **state)
{
    (void)state;
    /* the relay's defaults: 1s base, 5m max */
    assert_int_equal(idemp_backoff_delay(1000, 300000, 9), 256000);
    assert_int_equal(idemp_backoff_delay(1000, 300000, 10), 300000);
    /* a ms base */
    assert_int_equal(idemp_backoff_delay(200, 5000, 1), 200);
    assert_int_equal(idemp_backoff_delay(200, 5000, 2), 400);
    assert_int_equal(idemp_backoff_delay(200, 5000, 5), 3200);
    assert_int_equal(idemp_backoff_delay(200, 5000, 6), 5000);
    /* max below base: the cap wins from the first try */
    assert_int_equal(idemp_backoff_delay(5000, 1000, 1), 1000);
    assert_int_equal(idemp_backoff_delay(5000, 1000, 3), 1000);
    /* base equal to max */
    assert_int_equal(idemp_backoff_delay(1000, 1000, 1), 1000);
    assert_int_equal(idemp_backoff_delay(1000, 1000, 4), 1000);
    /* a doubling that lands exactly on the cap */
    assert_int_equal(idemp_backoff_delay(1000, 8000, 4), 8000);
    assert_int_equal(idemp_backoff_delay(1000, 8000, 5), 8000);
}

static void test_no_overflow(void **state)
{
    (void)state;
    /* a huge cap and many tries must not overflow into a negative or small delay */
    const int64_t max = INT64_MAX / 2;
    int64_t prev = 0;
    for (int n = 1; n <= 200; n++) {
        int64_t d = idemp_backoff_delay(1000, max, n);
        assert_true(d > 0);
        assert_true(d <= max);
        assert_true(d >= prev);
        prev = d;
    }
    assert_int_equal(prev, max);
}

/* The cap may be as large as int64 allows (a duration flag can reach it): doubling must stop
 * at the cap instead of overflowing. */
static void test_huge_cap(void **state)
{
    (void)state;
    int64_t prev = 0;
    for (int n = 1; n <= 100; n++) {
        int64_t d = idemp_backoff_delay(1000, INT64_MAX, n);
        if (d <= 0 || d < prev)
            fail_msg("delay(1000, INT64_MAX, %d) = %lld after %lld", n, (long long)d,
                     (long long)prev);
        prev = d;
    }
    assert_int_equal(prev, INT64_MAX);
    assert_int_equal(idemp_backoff_delay(INT64_MAX / 2 + 1, INT64_MAX, 2), INT64_MAX);
}

static void test_next_reset(void **state)
{
    (void)state;
    idemp_backoff_t b;
    idemp_backoff_init(&b, 1000, 30000);
    /* the first attempt goes at once, then 1, 2, 4, 8, 16, 30, 30 s */
    const int64_t want[] = {0, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        assert_int_equal(idemp_backoff_next(&b), want[i]);

    /* after a success the schedule starts over */
    idemp_backoff_reset(&b);
    assert_int_equal(idemp_backoff_next(&b), 0);
    assert_int_equal(idemp_backoff_next(&b), 1000);
    assert_int_equal(idemp_backoff_next(&b), 2000);
    idemp_backoff_reset(&b);
    idemp_backoff_reset(&b); /* twice is the same as once */
    assert_int_equal(idemp_backoff_next(&b), 0);
    assert_int_equal(idemp_backoff_next(&b), 1000);
}

static void test_many_failures(void **state)
{
    (void)state;
    idemp_backoff_t b;
    idemp_backoff_init(&b, 500, 60000);
    int64_t last = -1;
    for (int i = 0; i < 10000; i++)
        last = idemp_backoff_next(&b);
    assert_int_equal(last, 60000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_contract_schedule), cmocka_unit_test(test_non_positive_n),
        cmocka_unit_test(test_other_bases),       cmocka_unit_test(test_no_overflow),
        cmocka_unit_test(test_huge_cap),          cmocka_unit_test(test_next_reset),
        cmocka_unit_test(test_many_failures),
    };
    return cmocka_run_group_tests_name("backoff", tests, NULL, NULL);
}
