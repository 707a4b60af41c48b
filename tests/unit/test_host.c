/* test_host.c - which hosts are this machine's loopback (src/util/host.c), for the tls=off warning.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "host.h"

static void test_loopback(void **state)
{
    (void)state;
    static const char *const yes[] = {
        "localhost", "LocalHost", "db.localhost",     "127.0.0.1", "127.1.2.3",
        "::1",       "[::1]",     "::ffff:127.0.0.1", "",          "/var/run/postgresql"};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        if (!idemp_host_loopback(yes[i]))
            fail_msg("%s: not taken as loopback", yes[i]);
    assert_true(idemp_host_loopback(NULL));
}

static void test_elsewhere(void **state)
{
    (void)state;
    static const char *const no[] = {
        "db.example.com", "10.0.0.5",       "128.0.0.1",    "192.168.1.1",      "::2",
        "[2001:db8::1]",  "localhost.evil", "notlocalhost", "127.0.0.1.nip.io", "[::1",
        "::ffff:10.0.0.1"};
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        if (idemp_host_loopback(no[i]))
            fail_msg("%s: taken as loopback", no[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_loopback),
        cmocka_unit_test(test_elsewhere),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
