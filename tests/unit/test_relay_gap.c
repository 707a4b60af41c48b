/* test_relay_gap.c - the relay's gap filter (src/relay/relay_batch.c): a subscription goes out only
 * as a run of consecutive pending rows from its first one, so a row skipped by this claim (another
 * relay held it) is never overtaken. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "relay_int.h"

static const char *kept(const gap_row_t *rows, size_t n, size_t max)
{
    static char out[128];
    bool keep[32];
    size_t k = idemp_relay_gap_filter(rows, n, max, keep);
    size_t o = 0, c = 0;
    out[0] = '\0';
    for (size_t i = 0; i < n; i++)
        if (keep[i]) {
            o += (size_t)snprintf(out + o, sizeof out - o, "%s%s", c++ ? "," : "", rows[i].seq);
        }
    assert_int_equal(k, c);
    return out;
}

static void test_runs_from_the_first_pending_row(void **state)
{
    (void)state;
    const gap_row_t rows[] = {
        {"A", "10", NULL},
        {"B", "11", NULL},
        {"A", "12", "10"},
        {"B", "13", "11"},
    };
    assert_string_equal(kept(rows, 4, 100), "10,11,12,13");
}

static void test_a_gap_stops_the_subscription(void **state)
{
    (void)state;
    /* A's pending row 11 was not claimed (another relay held it): 12 and after wait */
    const gap_row_t rows[] = {
        {"A", "10", NULL},
        {"A", "12", "11"},
        {"B", "13", NULL},
        {"A", "14", "12"},
    };
    assert_string_equal(kept(rows, 4, 100), "10,13");
}

static void test_not_from_the_first_row(void **state)
{
    (void)state;
    /* the claim began after A's first pending row (9): none of A goes */
    const gap_row_t rows[] = {{"A", "10", "9"}, {"B", "11", NULL}, {"A", "12", "10"}};
    assert_string_equal(kept(rows, 3, 100), "11");
}

static void test_batch_limit(void **state)
{
    (void)state;
    const gap_row_t rows[] = {{"A", "1", NULL}, {"B", "2", NULL}, {"A", "3", "1"}};
    assert_string_equal(kept(rows, 3, 2), "1,2");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_runs_from_the_first_pending_row),
        cmocka_unit_test(test_a_gap_stops_the_subscription),
        cmocka_unit_test(test_not_from_the_first_row),
        cmocka_unit_test(test_batch_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
