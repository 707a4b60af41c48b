/* test_error.c - status texts and the error object (src/util/error.c): every status has a text,
 * first error wins, NULL err, one-line text, passwords masked. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <idem/error.h>

static void test_every_status_has_text(void **state)
{
    (void)state;
    assert_int_equal(IDEM_STATUS_MIN, IDEM_ERR_UNENCODABLE);
    for (int s = IDEM_OK; s >= IDEM_STATUS_MIN; s--) {
        const char *t = idem_strerror(s);
        if (t == NULL || t[0] == '\0' || strcmp(t, "unknown status") == 0)
            fail_msg("status %d has no text ('%s')", s, t ? t : "(null)");
        /* distinct texts, so a log line tells the statuses apart */
        for (int o = IDEM_OK; o > s; o--)
            if (strcmp(t, idem_strerror(o)) == 0)
                fail_msg("statuses %d and %d share the text '%s'", s, o, t);
    }
}

static void test_known_texts(void **state)
{
    (void)state;
    assert_string_equal(idem_strerror(IDEM_OK), "success");
    assert_string_equal(idem_strerror(IDEM_ERR_NOMEM), "out of memory");
    assert_string_equal(idem_strerror(IDEM_ERR_INVALID), "invalid argument");
    assert_non_null(strstr(idem_strerror(IDEM_ERR_PG_CONNECT), "PostgreSQL"));
    assert_non_null(strstr(idem_strerror(IDEM_ERR_AMQP_CONNECT), "RabbitMQ"));
    assert_string_equal(idem_strerror(IDEM_ERR_INTERRUPTED), "interrupted");
}

static void test_out_of_range(void **state)
{
    (void)state;
    const int bad[] = {1, 2, 100, IDEM_STATUS_MIN - 1, IDEM_STATUS_MIN - 100, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *t = idem_strerror(bad[i]);
        assert_non_null(t);
        assert_string_equal(t, "unknown status");
    }
}

static void test_set_basic(void **state)
{
    (void)state;
    idem_error_t e;
    idem_error_clear(&e);
    assert_int_equal(e.code, 0);
    assert_string_equal(e.text, "");
    assert_string_equal(e.sqlstate, "");

    int rc = idem_error_set(&e, IDEM_ERR_PG_QUERY, "COMMIT failed: %s (%d)", "boom", 42);
    assert_int_equal(rc, IDEM_ERR_PG_QUERY);
    assert_int_equal(e.code, IDEM_ERR_PG_QUERY);
    assert_string_equal(e.text, "COMMIT failed: boom (42)");
    assert_string_equal(e.sqlstate, "");
}

static void test_first_error_wins(void **state)
{
    (void)state;
    idem_error_t e;
    idem_error_clear(&e);
    assert_int_equal(idem_error_set(&e, IDEM_ERR_AMQP_LOST, "first"), IDEM_ERR_AMQP_LOST);
    /* the second call still returns its own code, for `return idem_error_set(...)` */
    assert_int_equal(idem_error_set(&e, IDEM_ERR_TIMEOUT, "second"), IDEM_ERR_TIMEOUT);
    assert_int_equal(e.code, IDEM_ERR_AMQP_LOST);
    assert_string_equal(e.text, "first");

    /* clear makes room for a new one */
    idem_error_clear(&e);
    assert_int_equal(e.code, 0);
    assert_string_equal(e.text, "");
    assert_int_equal(idem_error_set(&e, IDEM_ERR_TIMEOUT, "third"), IDEM_ERR_TIMEOUT);
    assert_int_equal(e.code, IDEM_ERR_TIMEOUT);
    assert_string_equal(e.text, "third");
}

static void test_null_err(void **state)
{
    (void)state;
    assert_int_equal(idem_error_set(NULL, IDEM_ERR_IO, "x %s", "y"), IDEM_ERR_IO);
    assert_int_equal(idem_error_set(NULL, IDEM_ERR_NOMEM, "out of memory"), IDEM_ERR_NOMEM);
    idem_error_clear(NULL);
}

static void test_one_line(void **state)
{
    (void)state;
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"ERROR:  boom\n", "ERROR:  boom"},
        {"line one\nline two\n", "line one line two"},
        {"a\nb\nc", "a b c"},
        {"cr\rhere", "cr here"},
        {"\nleading", " leading"},
        {"no newline", "no newline"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        idem_error_t e;
        idem_error_clear(&e);
        idem_error_set(&e, IDEM_ERR_PG_QUERY, "%s", cases[i].in);
        assert_string_equal(e.text, cases[i].want);
    }
    /* CRLF: no control characters remain */
    idem_error_t e;
    idem_error_clear(&e);
    idem_error_set(&e, IDEM_ERR_PG_QUERY, "x\r\ny\r\n");
    assert_null(strchr(e.text, '\n'));
    assert_null(strchr(e.text, '\r'));
    assert_true(strncmp(e.text, "x", 1) == 0);
    assert_non_null(strstr(e.text, "y"));
}

static void test_masks_passwords(void **state)
{
    (void)state;
    idem_error_t e;

    idem_error_clear(&e);
    idem_error_set(&e, IDEM_ERR_AMQP_CONNECT, "invalid AMQP URL: %s",
                   "amqp://bob:hunter2@rabbit:5672/vh");
    assert_string_equal(e.text, "invalid AMQP URL: amqp://bob:***@rabbit:5672/vh");

    idem_error_clear(&e);
    idem_error_set(&e, IDEM_ERR_PG_CONNECT, "cannot connect to %s: %s",
                   "host=db password=hunter2 user=app", "refused");
    assert_null(strstr(e.text, "hunter2"));
    assert_string_equal(e.text, "cannot connect to host=db password=*** user=app: refused");

    /* a password in a multi-line server message is masked after flattening */
    idem_error_clear(&e);
    idem_error_set(&e, IDEM_ERR_PG_CONNECT, "bad uri\npostgresql://u:hunter2@h/db\n");
    assert_null(strstr(e.text, "hunter2"));
    assert_string_equal(e.text, "bad uri postgresql://u:***@h/db");
}

static void test_long_text_truncated(void **state)
{
    (void)state;
    char big[2000];
    memset(big, 'q', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    idem_error_t e;
    idem_error_clear(&e);
    idem_error_set(&e, IDEM_ERR_PARSE, "%s", big);
    assert_int_equal(e.code, IDEM_ERR_PARSE);
    assert_int_equal(strlen(e.text), sizeof e.text - 1);
    assert_true(strspn(e.text, "q") == sizeof e.text - 1);
}

static void test_truncation_keeps_passwords_masked(void **state)
{
    (void)state;
    /* A URL whose '@' falls past the end of the text buffer: what is left of the password
     * must not appear. */
    char pad[600];
    for (size_t cut = 440; cut < 512; cut += 7) {
        memset(pad, 'p', cut);
        pad[cut] = '\0';
        idem_error_t e;
        idem_error_clear(&e);
        idem_error_set(&e, IDEM_ERR_AMQP_CONNECT, "%s amqp://user:supersecretpassword@host/", pad);
        if (strstr(e.text, "supersec") != NULL || strstr(e.text, "user:s") != NULL)
            fail_msg("password leaked with %zu bytes before the URL: ...%s", cut, e.text + cut - 5);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_status_has_text),
        cmocka_unit_test(test_known_texts),
        cmocka_unit_test(test_out_of_range),
        cmocka_unit_test(test_set_basic),
        cmocka_unit_test(test_first_error_wins),
        cmocka_unit_test(test_null_err),
        cmocka_unit_test(test_one_line),
        cmocka_unit_test(test_masks_passwords),
        cmocka_unit_test(test_long_text_truncated),
        cmocka_unit_test(test_truncation_keeps_passwords_masked),
    };
    return cmocka_run_group_tests_name("error", tests, NULL, NULL);
}
