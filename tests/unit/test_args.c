/* test_args.c - the CLI flag parser (src/cli/args.c): values, bounds, forms, global flags. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "args.h"

/* The flags of one imaginary command, reset before every test. */
struct flags {
    bool force;
    int batch;
    const char *name;
    cli_list_t binds;
    int64_t window_ms;
    int64_t poll_ms;
};

static struct flags F;
static cli_global_t G;

static const cli_opt_t *opts(void)
{
    static cli_opt_t o[7];
    const cli_opt_t table[] = {
        {"--force", OPT_FLAG, &F.force, NULL, NULL, "force", 0, 0},
        {"--batch", OPT_INT, &F.batch, "N", "5000", "rows per batch", 1, 1000},
        {"--name", OPT_STRING, &F.name, "NAME", NULL, "a name", 0, 0},
        {"--bind", OPT_LIST, &F.binds, "KEY", NULL, "binding key", 0, 0},
        {"--window", OPT_DURATION, &F.window_ms, "DURATION", "30d", "window", 0, 0},
        {"--poll", OPT_DURATION_MS, &F.poll_ms, "DURATION", "200ms", "poll", 0, 0},
        {0},
    };
    memcpy(o, table, sizeof table);
    return o;
}

static int setup(void **state)
{
    (void)state;
    memset(&F, 0, sizeof F);
    F.batch = 5000;
    F.window_ms = -1;
    F.poll_ms = -1;
    unsetenv("IDEM_PG_URL");
    unsetenv("IDEM_AMQP_URL");
    unsetenv("IDEM_EXCHANGE");
    cli_global_init(&G);
    return 0;
}

/* Parses the NULL-terminated argument list as the command "test" would receive it. */
static int parse(const char *first, ...)
{
    char *argv[32];
    int argc = 0;
    argv[argc++] = (char *)"test";
    va_list ap;
    va_start(ap, first);
    for (const char *a = first; a != NULL && argc < 31; a = va_arg(ap, const char *))
        argv[argc++] = (char *)a;
    va_end(ap);
    argv[argc] = NULL;
    return cli_parse("test", "[FLAGS]", argc, argv, opts(), &G);
}

static void test_no_args_keeps_defaults(void **state)
{
    (void)state;
    assert_int_equal(parse(NULL), 0);
    assert_int_equal(F.batch, 5000);
    assert_false(F.force);
    assert_null(F.name);
    assert_int_equal(F.binds.n, 0);
    assert_string_equal(G.pg, "");
    assert_string_equal(G.amqp, "amqp://guest:guest@127.0.0.1:5672");
    assert_string_equal(G.exchange, "billing.events");
    assert_int_equal(G.level, IDEM_LOG_INFO);
    assert_int_equal(G.format, IDEM_LOG_TEXT);
}

static void test_durations_with_units(void **state)
{
    (void)state;
    assert_int_equal(parse("--window", "90s", NULL), 0);
    assert_true(F.window_ms == 90 * 1000LL);
    assert_int_equal(parse("--window", "15m", NULL), 0);
    assert_true(F.window_ms == 15 * 60 * 1000LL);
    assert_int_equal(parse("--window", "2h", NULL), 0);
    assert_true(F.window_ms == 2 * 3600 * 1000LL);
    assert_int_equal(parse("--window", "7d", NULL), 0);
    assert_true(F.window_ms == 7 * 86400 * 1000LL);
    assert_int_equal(parse("--poll", "200ms", NULL), 0);
    assert_true(F.poll_ms == 200);
    assert_int_equal(parse("--poll", "5s", NULL), 0);
    assert_true(F.poll_ms == 5000);
}

static void test_durations_without_unit_or_bad(void **state)
{
    (void)state;
    F.window_ms = 123;
    assert_int_equal(parse("--window", "30", NULL), CLI_EXIT_USAGE);    /* unit required */
    assert_int_equal(parse("--window", "200ms", NULL), CLI_EXIT_USAGE); /* ms not here */
    assert_int_equal(parse("--window", "", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--window", "d", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--window", "-5s", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--window", "5x", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--window", "5 s", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--poll", "200", NULL), CLI_EXIT_USAGE);
    assert_true(F.window_ms == 123); /* a rejected value leaves the destination alone */
}

static void test_int_bounds(void **state)
{
    (void)state;
    assert_int_equal(parse("--batch", "1", NULL), 0);
    assert_int_equal(F.batch, 1);
    assert_int_equal(parse("--batch", "1000", NULL), 0);
    assert_int_equal(F.batch, 1000);
    assert_int_equal(parse("--batch", "0", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--batch", "1001", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--batch", "-3", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--batch", "12x", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--batch", "", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--batch", "99999999999999999999", NULL), CLI_EXIT_USAGE);
    assert_int_equal(F.batch, 1000);
}

static void test_unknown_flag_is_usage_error(void **state)
{
    (void)state;
    assert_int_equal(parse("--nope", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--nope=1", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--batc", "5", NULL), CLI_EXIT_USAGE); /* no prefix matching */
    assert_int_equal(parse("-b", "5", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("stray", NULL), CLI_EXIT_USAGE);
}

/* A usage error is exactly one line on stderr naming the command and the flag. */
static void test_usage_error_is_one_line(void **state)
{
    (void)state;
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    FILE *saved = stderr;
    stderr = tmp;
    int rc = parse("--batch", "5", "--bogus", NULL);
    stderr = saved;
    assert_int_equal(rc, CLI_EXIT_USAGE);
    char buf[512] = {0};
    rewind(tmp);
    size_t n = fread(buf, 1, sizeof buf - 1, tmp);
    fclose(tmp);
    assert_true(n > 0);
    assert_non_null(strstr(buf, "idem test: "));
    assert_non_null(strstr(buf, "--bogus"));
    assert_non_null(strchr(buf, '\n'));
    assert_string_equal(strchr(buf, '\n'), "\n"); /* the only newline ends the text */
}

static void test_missing_value(void **state)
{
    (void)state;
    assert_int_equal(parse("--batch", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--force", "--name", NULL), CLI_EXIT_USAGE);
    assert_true(F.force);
}

static void test_equals_form(void **state)
{
    (void)state;
    assert_int_equal(parse("--batch=7", "--name=a=b", "--window=3d", "--poll=50ms", NULL), 0);
    assert_int_equal(F.batch, 7);
    assert_string_equal(F.name, "a=b"); /* only the first '=' splits */
    assert_true(F.window_ms == 3 * 86400 * 1000LL);
    assert_true(F.poll_ms == 50);
    assert_int_equal(parse("--name=", NULL), 0);
    assert_string_equal(F.name, "");
    assert_int_equal(parse("--force=yes", NULL), CLI_EXIT_USAGE); /* a flag takes no value */
    assert_int_equal(parse("--batch=0", NULL), CLI_EXIT_USAGE);
}

static void test_value_may_start_with_dashes(void **state)
{
    (void)state;
    /* "--name VALUE" consumes the next argument whatever it looks like */
    assert_int_equal(parse("--name", "--force", NULL), 0);
    assert_string_equal(F.name, "--force");
    assert_false(F.force);
}

static void test_lists(void **state)
{
    (void)state;
    assert_int_equal(
        parse("--bind", "invoice.paid", "--bind=payment.failed", "--bind", "a.#", NULL), 0);
    assert_int_equal(F.binds.n, 3);
    assert_string_equal(F.binds.items[0], "invoice.paid");
    assert_string_equal(F.binds.items[1], "payment.failed");
    assert_string_equal(F.binds.items[2], "a.#");
    assert_null(F.binds.items[3]);
    assert_int_equal(parse("--bind", "", NULL), CLI_EXIT_USAGE);
    assert_int_equal(F.binds.n, 3);
}

static void test_list_limit(void **state)
{
    (void)state;
    char *argv[2 * CLI_LIST_MAX + 4];
    int argc = 0;
    argv[argc++] = (char *)"test";
    for (int i = 0; i < CLI_LIST_MAX + 1; i++) {
        argv[argc++] = (char *)"--bind";
        argv[argc++] = (char *)"k";
    }
    argv[argc] = NULL;
    assert_int_equal(cli_parse("test", "", argc, argv, opts(), &G), CLI_EXIT_USAGE);
    assert_int_equal(F.binds.n, CLI_LIST_MAX);
    assert_null(F.binds.items[CLI_LIST_MAX]);
}

static void test_global_flags_after_command(void **state)
{
    (void)state;
    assert_int_equal(parse("--batch", "9", "--pg", "host=db port=5433", "--amqp",
                           "amqp://u:p@h:1/v", "--exchange=ex", "--log-level", "debug",
                           "--log-format=json", "--force", NULL),
                     0);
    assert_int_equal(F.batch, 9);
    assert_true(F.force);
    assert_string_equal(G.pg, "host=db port=5433");
    assert_string_equal(G.amqp, "amqp://u:p@h:1/v");
    assert_string_equal(G.exchange, "ex");
    assert_int_equal(G.level, IDEM_LOG_DEBUG);
    assert_int_equal(G.format, IDEM_LOG_JSON);
    idem_log_set_level(IDEM_LOG_INFO); /* cli_parse applied them process-wide */
    idem_log_set_format(IDEM_LOG_TEXT);
}

static void test_bad_global_values(void **state)
{
    (void)state;
    assert_int_equal(parse("--log-level", "loud", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--log-format", "xml", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--exchange", "", NULL), CLI_EXIT_USAGE);
    assert_int_equal(parse("--pg", NULL), CLI_EXIT_USAGE);
}

static void test_environment_and_flag_precedence(void **state)
{
    (void)state;
    setenv("IDEM_PG_URL", "postgresql://env@h/db", 1);
    setenv("IDEM_EXCHANGE", "env.exchange", 1);
    setenv("IDEM_AMQP_URL", "", 1); /* empty means the default */
    cli_global_init(&G);
    assert_int_equal(parse(NULL), 0);
    assert_string_equal(G.pg, "postgresql://env@h/db");
    assert_string_equal(G.exchange, "env.exchange");
    assert_string_equal(G.amqp, "amqp://guest:guest@127.0.0.1:5672");
    assert_int_equal(parse("--pg", "host=flag", "--exchange", "flag.exchange", NULL), 0);
    assert_string_equal(G.pg, "host=flag");
    assert_string_equal(G.exchange, "flag.exchange");
    unsetenv("IDEM_PG_URL");
    unsetenv("IDEM_EXCHANGE");
    unsetenv("IDEM_AMQP_URL");
}

static void test_help(void **state)
{
    (void)state;
    /* help goes to stdout; keep the test output quiet */
    FILE *saved = stdout;
    FILE *devnull = fopen("/dev/null", "w");
    assert_non_null(devnull);
    stdout = devnull;
    int rc1 = parse("--help", NULL);
    int rc2 = parse("--batch", "5", "-h", NULL);
    stdout = saved;
    fclose(devnull);
    assert_int_equal(rc1, CLI_HELP_SHOWN);
    assert_int_equal(rc2, CLI_HELP_SHOWN);
}

static void test_usage_error_returns_2(void **state)
{
    (void)state;
    assert_int_equal(cli_usage_error("test", "bad %s", "thing"), CLI_EXIT_USAGE);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_no_args_keeps_defaults, setup),
        cmocka_unit_test_setup(test_durations_with_units, setup),
        cmocka_unit_test_setup(test_durations_without_unit_or_bad, setup),
        cmocka_unit_test_setup(test_int_bounds, setup),
        cmocka_unit_test_setup(test_unknown_flag_is_usage_error, setup),
        cmocka_unit_test_setup(test_usage_error_is_one_line, setup),
        cmocka_unit_test_setup(test_missing_value, setup),
        cmocka_unit_test_setup(test_equals_form, setup),
        cmocka_unit_test_setup(test_value_may_start_with_dashes, setup),
        cmocka_unit_test_setup(test_lists, setup),
        cmocka_unit_test_setup(test_list_limit, setup),
        cmocka_unit_test_setup(test_global_flags_after_command, setup),
        cmocka_unit_test_setup(test_bad_global_values, setup),
        cmocka_unit_test_setup(test_environment_and_flag_precedence, setup),
        cmocka_unit_test_setup(test_help, setup),
        cmocka_unit_test_setup(test_usage_error_returns_2, setup),
    };
    return cmocka_run_group_tests_name("args", tests, NULL, NULL);
}
