/* test_event.c - which statements idem_event_exec refuses as ending or beginning the claim's
 * transaction (src/core/event.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "event.h"

static void test_refused(void **state)
{
    (void)state;
    static const char *const ends[] = {"COMMIT",
                                       "commit;",
                                       " \n\tRollback",
                                       "ROLLBACK AND CHAIN",
                                       "END",
                                       "abort",
                                       "BEGIN",
                                       "begin isolation level serializable",
                                       "START TRANSACTION",
                                       "PREPARE TRANSACTION 'x'",
                                       "COMMIT PREPARED 'x'",
                                       "ROLLBACK PREPARED 'x'"};
    for (size_t i = 0; i < sizeof ends / sizeof ends[0]; i++)
        if (!idemp_sql_ends_transaction(ends[i]))
            fail_msg("%s: not refused", ends[i]);
}

static void test_allowed(void **state)
{
    (void)state;
    static const char *const ok[] = {"ROLLBACK TO SAVEPOINT s",
                                     "rollback to s",
                                     "SAVEPOINT s",
                                     "RELEASE SAVEPOINT s",
                                     "INSERT INTO t VALUES (1)",
                                     "SELECT 'COMMIT'",
                                     "PREPARE p AS SELECT 1",
                                     "UPDATE commits SET n = 1",
                                     "",
                                     "SET LOCAL work_mem = '64MB'"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (idemp_sql_ends_transaction(ok[i]))
            fail_msg("%s: refused", ok[i]);
    assert_false(idemp_sql_ends_transaction(NULL));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_allowed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
