/* test_policy.c - the consumer's failure policy (src/core/policy.c): which SQLSTATEs retry, reject
 * or pause, for a handler's statement and for COMMIT. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "policy.h"

static void expect(idemp_policy (*fn)(const char *), const char *state, idemp_policy want)
{
    idemp_policy got = fn(state);
    if (got != want)
        fail_msg("%s: got %s, want %s", state ? state : "(null)", idemp_policy_name(got),
                 idemp_policy_name(want));
}

static void test_handler_retry(void **state)
{
    (void)state;
    static const char *const retry[] = {"40001", "40P01", "55P03", "57014"};
    for (size_t i = 0; i < sizeof retry / sizeof retry[0]; i++)
        expect(idemp_policy_for_handler, retry[i], IDEMP_POLICY_RETRY);
}

static void test_handler_reject(void **state)
{
    (void)state;
    static const char *const reject[] = {"22001", "22003", "22P02", "22023", "23502", "23503",
                                         "23505", "23514", "P0001",
                                         /* the handler ended, or tried to end, the transaction */
                                         "2D000", "2DP01",
                                         /* SELECT ... INTO STRICT: no rows, too many; ASSERT */
                                         "P0002", "P0003", "P0004"};
    for (size_t i = 0; i < sizeof reject / sizeof reject[0]; i++)
        expect(idemp_policy_for_handler, reject[i], IDEMP_POLICY_REJECT);
}

static void test_handler_pause(void **state)
{
    (void)state;
    /* the environment, not the event: read-only after a failover, privileges, a missing table,
     * a full disk, out of memory, a shutdown, a lost connection (no SQLSTATE) */
    static const char *const pause[] = {"25006", "42501", "42P01", "42883", "53100", "53200",
                                        "57P01", "57P03", "08006", "XX000", "40003", "25P02"};
    for (size_t i = 0; i < sizeof pause / sizeof pause[0]; i++)
        expect(idemp_policy_for_handler, pause[i], IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_handler, "", IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_handler, NULL, IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_handler, "4000", IDEMP_POLICY_PAUSE);
}

static void test_commit(void **state)
{
    (void)state;
    expect(idemp_policy_for_commit, "40001", IDEMP_POLICY_RETRY);
    expect(idemp_policy_for_commit, "40P01", IDEMP_POLICY_RETRY);
    expect(idemp_policy_for_commit, "23505", IDEMP_POLICY_REJECT); /* a deferred constraint */
    /* idem_claim_commit: a handler ended the claim's transaction or changed a setting it needs */
    expect(idemp_policy_for_commit, "IDEM2", IDEMP_POLICY_REJECT);
    /* a timeout or a cancel at COMMIT is the server's trouble: nothing to blame on the event */
    expect(idemp_policy_for_commit, "57014", IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_commit, "55P03", IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_commit, "25006", IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_commit, "53100", IDEMP_POLICY_PAUSE);
    expect(idemp_policy_for_commit, "", IDEMP_POLICY_PAUSE);
}

static void test_names(void **state)
{
    (void)state;
    assert_string_equal(idemp_policy_name(IDEMP_POLICY_RETRY), "retry");
    assert_string_equal(idemp_policy_name(IDEMP_POLICY_REJECT), "reject");
    assert_string_equal(idemp_policy_name(IDEMP_POLICY_PAUSE), "pause");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handler_retry), cmocka_unit_test(test_handler_reject),
        cmocka_unit_test(test_handler_pause), cmocka_unit_test(test_commit),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
