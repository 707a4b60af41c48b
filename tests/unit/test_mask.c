/* test_mask.c - password masking and "host:port" for messages (src/mask.c), and the AMQP URL
 * parser (src/rmq.c) whose passwords the masking must hide. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <idem/error.h>

#include "mask.h"
#include "pg.h"
#include "rmq.h"

static char out[1024];

static const char *mask(const char *in)
{
    memset(out, 'Z', sizeof out);
    idemp_mask_secrets(in, out, sizeof out);
    return out;
}

static void expect_mask(const char *in, const char *want)
{
    const char *got = mask(in);
    if (strcmp(got, want) != 0)
        fail_msg("mask(\"%s\")\n  got  \"%s\"\n  want \"%s\"", in, got, want);
}

/* ---- idemp_mask_secrets ---- */

static void test_urls(void **state)
{
    (void)state;
    expect_mask("amqp://user:secret@host:5672/vh", "amqp://user:***@host:5672/vh");
    expect_mask("postgresql://u:p@h/db", "postgresql://u:***@h/db");
    expect_mask("postgres://app:s3cr3t@db.example.com:6543/billing?sslmode=require",
                "postgres://app:***@db.example.com:6543/billing?sslmode=require");
    expect_mask("amqps://guest:guest@127.0.0.1", "amqps://guest:***@127.0.0.1");
    /* percent-encoded password */
    expect_mask("amqp://u:p%40ss%2Fw@h/", "amqp://u:***@h/");
    /* empty password and empty user */
    expect_mask("amqp://u:@h/", "amqp://u:***@h/");
    expect_mask("amqp://:pw@h/", "amqp://:***@h/");
    /* inside a message, and two of them */
    expect_mask("cannot connect to amqp://u:pw@h:5672: refused",
                "cannot connect to amqp://u:***@h:5672: refused");
    expect_mask("from amqp://a:one@h1/ to postgresql://b:two@h2/db",
                "from amqp://a:***@h1/ to postgresql://b:***@h2/db");
}

static void test_urls_without_password(void **state)
{
    (void)state;
    static const char *const same[] = {
        "amqp://user@host:5672/vh",
        "amqp://host:5672/vh",
        "amqp://host:5672",
        "postgresql://h/db",
        "postgresql:///db",
        "postgresql://h:5432/db?user=u",
        "http://example.com/a:b@c",  /* the '@' is in the path, not userinfo */
        "amqp://host:5672 user:x@y", /* userinfo ends at whitespace */
        "no url here: a:b@c",
        "",
        "plain text",
        "ratio 3:1 at noon",
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        expect_mask(same[i], same[i]);
}

static void test_conninfo(void **state)
{
    (void)state;
    expect_mask("host=x password=secret user=y", "host=x password=*** user=y");
    expect_mask("password=secret", "password=***");
    expect_mask("host=x password=secret", "host=x password=***");
    expect_mask("host=x password='a b' user=y", "host=x password=*** user=y");
    expect_mask("password='a b'", "password=***");
    expect_mask("password = 'with spaces' dbname=d", "password=*** dbname=d");
    expect_mask("password= spaced user=y", "password=*** user=y");
    /* backslash-escaped quote inside the quoted value */
    expect_mask("password='it\\'s secret' user=y", "password=*** user=y");
    /* an unterminated quote: everything after it is hidden */
    expect_mask("password='never closed user=y", "password=***");
    /* empty value */
    expect_mask("password='' user=y", "password=*** user=y");
    /* query parameter of a URI */
    expect_mask("postgresql://h/db?password=secret&sslmode=require",
                "postgresql://h/db?password=***&sslmode=require");
    expect_mask("postgresql://h/db?sslmode=require&password=secret",
                "postgresql://h/db?sslmode=require&password=***");
    /* in a message */
    expect_mask("connect \"host=db password=hunter2 port=5433\" failed",
                "connect \"host=db password=*** port=5433\" failed");
    /* tab ends the value too */
    expect_mask("password=abc\tuser=y", "password=***\tuser=y");
}

static void test_conninfo_not_a_keyword(void **state)
{
    (void)state;
    /* "password" as part of a longer word, or without '=', is left alone */
    expect_mask("mypassword=abc", "mypassword=abc");
    expect_mask("password is wrong", "password is wrong");
    expect_mask("password: none", "password: none");
    expect_mask("FATAL:  password authentication failed for user \"app\"",
                "FATAL:  password authentication failed for user \"app\"");
}

static void test_no_secret_survives(void **state)
{
    (void)state;
    static const char *const inputs[] = {
        "amqp://user:SECRET@host:5672/vh",   "postgresql://u:SECRET@h/db",
        "host=x password=SECRET user=y",     "host=x password='SECRET and more' user=y",
        "postgresql://h/db?password=SECRET", "x amqp://u:SECRET@h y password=SECRET z",
    };
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) {
        mask(inputs[i]);
        if (strstr(out, "SECRET") != NULL || strstr(out, "more") != NULL)
            fail_msg("mask(\"%s\") = \"%s\" leaks", inputs[i], out);
        assert_non_null(strstr(out, "***"));
    }
}

static void test_truncation(void **state)
{
    (void)state;
    const char *in = "amqp://user:secret@host:5672/vh";
    char buf[64];
    /* every output size from 1 up: NUL-terminated, within bounds, a prefix of the full
     * result, never the secret */
    char full[64];
    idemp_mask_secrets(in, full, sizeof full);
    assert_string_equal(full, "amqp://user:***@host:5672/vh");
    for (size_t sz = 1; sz <= sizeof full; sz++) {
        memset(buf, 'Z', sizeof buf);
        idemp_mask_secrets(in, buf, sz);
        size_t len = strnlen(buf, sz);
        assert_true(len < sz); /* terminated inside the buffer */
        assert_int_equal(len, sz - 1 < strlen(full) ? sz - 1 : strlen(full));
        assert_memory_equal(buf, full, len);
        for (size_t k = sz; k < sizeof buf; k++) /* nothing written past sz */
            assert_int_equal(buf[k], 'Z');
        assert_null(strstr(buf, "secret"));
    }

    /* the same for conninfo */
    in = "host=x password=secret user=y";
    for (size_t sz = 1; sz <= 40; sz++) {
        memset(buf, 'Z', sizeof buf);
        idemp_mask_secrets(in, buf, sz);
        assert_true(strnlen(buf, sz) < sz);
        assert_null(strstr(buf, "sec"));
        for (size_t k = sz; k < sizeof buf; k++)
            assert_int_equal(buf[k], 'Z');
    }

    /* size 0 writes nothing */
    memset(buf, 'Z', sizeof buf);
    idemp_mask_secrets(in, buf, 0);
    assert_int_equal(buf[0], 'Z');
}

static void test_long_input(void **state)
{
    (void)state;
    char in[3000];
    size_t n = 0;
    for (int i = 0; i < 60; i++)
        n += (size_t)snprintf(in + n, sizeof in - n, "amqp://u%d:pw%d@h%d/ ", i, i, i);
    char small[128];
    idemp_mask_secrets(in, small, sizeof small);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_null(strstr(small, "pw"));
    char big[4096];
    idemp_mask_secrets(in, big, sizeof big);
    assert_null(strstr(big, "pw"));
    assert_non_null(strstr(big, "amqp://u59:***@h59/"));
}

/* ---- idemp_pg_where ---- */

static void expect_where(const char *conninfo, const char *want)
{
    char where[300];
    memset(where, 'Z', sizeof where);
    idemp_pg_where(conninfo, where, sizeof where);
    if (strcmp(where, want) != 0)
        fail_msg("pg_where(\"%s\") = \"%s\", want \"%s\"", conninfo ? conninfo : "(null)", where,
                 want);
}

static int clear_pgenv(void **state)
{
    (void)state;
    unsetenv("PGHOST");
    unsetenv("PGPORT");
    unsetenv("PGHOSTADDR");
    return 0;
}

static void test_where_uri(void **state)
{
    (void)state;
    expect_where("postgresql://u:p@dbhost:6543/db", "dbhost:6543");
    expect_where("postgres://dbhost/db", "dbhost:5432");
    expect_where("postgresql://u@dbhost:5433", "dbhost:5433");
    expect_where("postgresql:///db", "localhost:5432");
    expect_where("postgresql://", "localhost:5432");
    expect_where("postgresql://:7000/db", "localhost:7000");
    expect_where("postgresql://h/db?port=6000", "h:6000");
    expect_where("postgresql:///db?host=/var/run/postgresql", "/var/run/postgresql:5432");
    expect_where("postgresql://[::1]:5433/db", "::1:5433");
    /* the password never reaches the result */
    char where[300];
    idemp_pg_where("postgresql://u:hunter2@h:1/db", where, sizeof where);
    assert_null(strstr(where, "hunter2"));
}

static void test_where_keyvalue(void **state)
{
    (void)state;
    expect_where("host=x port=5433 password=secret", "x:5433");
    expect_where("host=db.example.com dbname=billing", "db.example.com:5432");
    expect_where("port=6000", "localhost:6000");
    expect_where("dbname=billing user=app", "localhost:5432");
    expect_where("hostaddr=10.1.2.3 port=5444", "10.1.2.3:5444");
    expect_where("host=named hostaddr=10.1.2.3", "named:5432"); /* host wins for messages */
    expect_where("host='quoted host' port=1", "quoted host:1");
    expect_where("", "localhost:5432");
    expect_where(NULL, "localhost:5432");
    /* several hosts: each with its port, or the one port */
    expect_where("host=a,b port=5", "a:5,b:5");
    expect_where("host=a,b port=5,6", "a:5,b:6");
    expect_where("postgresql://u@h1:5432,h2:6543/db?target_session_attrs=read-write",
                 "h1:5432,h2:6543");
    /* unparseable: the defaults, not a crash */
    expect_where("host='unterminated", "localhost:5432");
    expect_where("nonsense", "localhost:5432");
}

static void test_where_env(void **state)
{
    (void)state;
    setenv("PGHOST", "envhost", 1);
    setenv("PGPORT", "7777", 1);
    expect_where("", "envhost:7777");
    expect_where("dbname=x", "envhost:7777");
    /* the conninfo wins over the environment */
    expect_where("host=x port=1", "x:1");
    expect_where("postgresql://uhost:2/db", "uhost:2");
    expect_where("host=x", "x:7777");
    unsetenv("PGHOST");
    unsetenv("PGPORT");
    expect_where("", "localhost:5432");
}

static void test_where_truncates(void **state)
{
    (void)state;
    char where[8];
    memset(where, 'Z', sizeof where);
    idemp_pg_where("host=averyveryverylonghostname port=5432", where, 6);
    assert_string_equal(where, "avery");
    assert_int_equal(where[6], 'Z');
}

/* ---- idemp_amqp_url_parse ---- */

static idemp_amqp_url_t U;

static void url_ok(const char *url)
{
    memset(&U, 0x5a, sizeof U);
    int rc = idemp_amqp_url_parse(url, &U);
    if (rc != IDEM_OK)
        fail_msg("amqp_url_parse(\"%s\") = %d, want 0", url, rc);
}

static void url_bad(const char *url)
{
    idemp_amqp_url_t u;
    int rc = idemp_amqp_url_parse(url, &u);
    if (rc != IDEM_ERR_INVALID)
        fail_msg("amqp_url_parse(\"%s\") = %d, want IDEM_ERR_INVALID", url ? url : "(null)", rc);
}

static void test_url_defaults(void **state)
{
    (void)state;
    url_ok("amqp://h");
    assert_string_equal(U.host, "h");
    assert_int_equal(U.port, 5672);
    assert_string_equal(U.user, "guest");
    assert_string_equal(U.password, "guest");
    assert_string_equal(U.vhost, "/");

    /* the CLI's default URL */
    url_ok("amqp://guest:guest@127.0.0.1:5672");
    assert_string_equal(U.host, "127.0.0.1");
    assert_int_equal(U.port, 5672);
    assert_string_equal(U.user, "guest");
    assert_string_equal(U.password, "guest");
    assert_string_equal(U.vhost, "/");

    url_ok("amqp://");
    assert_string_equal(U.host, "localhost");
    assert_int_equal(U.port, 5672);
    assert_string_equal(U.vhost, "/");
}

static void test_url_full(void **state)
{
    (void)state;
    url_ok("amqp://u:p@h:1234");
    assert_string_equal(U.user, "u");
    assert_string_equal(U.password, "p");
    assert_string_equal(U.host, "h");
    assert_int_equal(U.port, 1234);
    assert_string_equal(U.vhost, "/");

    url_ok("amqp://alice:wonder@rabbit.example.com:5671/billing");
    assert_string_equal(U.user, "alice");
    assert_string_equal(U.password, "wonder");
    assert_string_equal(U.host, "rabbit.example.com");
    assert_int_equal(U.port, 5671);
    assert_string_equal(U.vhost, "billing");

    /* user without password keeps the default password */
    url_ok("amqp://bob@h");
    assert_string_equal(U.user, "bob");
    assert_string_equal(U.password, "guest");

    /* empty password is a password */
    url_ok("amqp://bob:@h");
    assert_string_equal(U.user, "bob");
    assert_string_equal(U.password, "");

    url_ok("amqp://[::1]:5673/v");
    assert_string_equal(U.host, "::1");
    assert_int_equal(U.port, 5673);
    assert_string_equal(U.vhost, "v");

    url_ok("amqp://[fe80::1]");
    assert_string_equal(U.host, "fe80::1");
    assert_int_equal(U.port, 5672);

    url_ok("amqp://h:65535");
    assert_int_equal(U.port, 65535);
    url_ok("amqp://h:1");
    assert_int_equal(U.port, 1);
}

static void test_url_vhost(void **state)
{
    (void)state;
    url_ok("amqp://h/");
    assert_string_equal(U.vhost, "/");
    url_ok("amqp://h/%2f");
    assert_string_equal(U.vhost, "/");
    url_ok("amqp://h/%2F");
    assert_string_equal(U.vhost, "/");
    url_ok("amqp://h:5672/%2f");
    assert_string_equal(U.vhost, "/");
    assert_string_equal(U.host, "h");
    url_ok("amqp://h/vh");
    assert_string_equal(U.vhost, "vh");
    url_ok("amqp://h/%2fvh");
    assert_string_equal(U.vhost, "/vh");
    url_ok("amqp://h/my%20vhost");
    assert_string_equal(U.vhost, "my vhost");
    url_ok("amqp://h/vh?heartbeat=10");
    assert_string_equal(U.vhost, "vh");
    url_ok("amqp://h?heartbeat=10");
    assert_string_equal(U.host, "h");
    assert_string_equal(U.vhost, "/");
}

static void test_url_percent(void **state)
{
    (void)state;
    url_ok("amqp://us%65r:p%40ss%3Aw%2Fo%25rd@h/");
    assert_string_equal(U.user, "user");
    assert_string_equal(U.password, "p@ss:w/o%rd");
    assert_string_equal(U.host, "h");
    assert_string_equal(U.vhost, "/");

    url_bad("amqp://u:p%4@h/");  /* short escape */
    url_bad("amqp://u:p%zz@h/"); /* not hex */
    url_bad("amqp://u:p%@h/");
    url_bad("amqp://h/v%g1");
}

static void test_url_tls_and_query(void **state)
{
    (void)state;
    url_ok("amqps://h");
    assert_true(U.tls);
    assert_int_equal(U.port, 5671);
    assert_true(U.verify_peer);
    assert_int_equal(U.heartbeat_s, -1);
    url_ok("amqps://u:p@h:1234/v?cacertfile=%2Fetc%2Fca.pem&certfile=/c.pem&keyfile=/k.pem"
           "&verify=verify_none&server_name_indication=broker.example&heartbeat=7&other=x");
    assert_true(U.tls);
    assert_int_equal(U.port, 1234);
    assert_string_equal(U.vhost, "v");
    assert_string_equal(U.cacertfile, "/etc/ca.pem");
    assert_string_equal(U.certfile, "/c.pem");
    assert_string_equal(U.keyfile, "/k.pem");
    assert_false(U.verify_peer);
    assert_string_equal(U.sni, "broker.example");
    assert_int_equal(U.heartbeat_s, 7);
    url_ok("amqp://h/?heartbeat=0");
    assert_false(U.tls);
    assert_string_equal(U.vhost, "/");
    assert_int_equal(U.heartbeat_s, 0);
}

static void test_url_bad(void **state)
{
    (void)state;
    url_bad(NULL);
    url_bad("");
    url_bad("http://h");
    url_bad("amqps://h?verify=maybe"); /* verify_peer or verify_none */
    url_bad("amqp://h?heartbeat=x");
    url_bad("amqp://h?heartbeat=70000");
    url_bad("amqp://h?novalue");
    url_bad("AMQP//h");
    url_bad("h:5672");
    url_bad("amqp:/h");
    url_bad("amqp://h:");
    url_bad("amqp://h:0");
    url_bad("amqp://h:65536");
    url_bad("amqp://h:99999999999999999999");
    url_bad("amqp://h:-1");
    url_bad("amqp://h:12ab");
    url_bad("amqp://h:80x/");
    url_bad("amqp://[::1/");
    url_bad("amqp://[::1]x/");
}

static void test_url_too_long(void **state)
{
    (void)state;
    char url[1024];
    char big[400];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    snprintf(url, sizeof url, "amqp://%s/", big);
    url_bad(url); /* host longer than host[256] */
    snprintf(url, sizeof url, "amqp://u:%.200s@h/", big);
    url_bad(url); /* password longer than password[128] */
    snprintf(url, sizeof url, "amqp://h/%.200s", big);
    url_bad(url); /* vhost longer than vhost[128] */
}

/* What the parser takes for a password is what masking hides. */
static void test_url_mask_agree(void **state)
{
    (void)state;
    static const char *const urls[] = {
        "amqp://u:topsecret@h:5672/vh",
        "amqp://u:top%40secret@h/",
        "amqp://u:p@ss@h/",
    };
    for (size_t i = 0; i < sizeof urls / sizeof urls[0]; i++) {
        url_ok(urls[i]);
        mask(urls[i]);
        /* every 3-byte window of the raw (still encoded) password must be gone */
        const char *colon = strchr(urls[i] + 7, ':');
        const char *at = strrchr(urls[i], '@');
        for (const char *p = colon + 1; p + 3 <= at; p++) {
            char piece[4] = {p[0], p[1], p[2], '\0'};
            if (strstr(out, piece) != NULL && strstr("h:5672/vh", piece) == NULL)
                fail_msg("url %s: parser password '%s', masked as '%s' (shows '%s')", urls[i],
                         U.password, out, piece);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_urls),
        cmocka_unit_test(test_urls_without_password),
        cmocka_unit_test(test_conninfo),
        cmocka_unit_test(test_conninfo_not_a_keyword),
        cmocka_unit_test(test_no_secret_survives),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_long_input),
        cmocka_unit_test_setup(test_where_uri, clear_pgenv),
        cmocka_unit_test_setup(test_where_keyvalue, clear_pgenv),
        cmocka_unit_test_setup(test_where_env, clear_pgenv),
        cmocka_unit_test_setup(test_where_truncates, clear_pgenv),
        cmocka_unit_test(test_url_defaults),
        cmocka_unit_test(test_url_full),
        cmocka_unit_test(test_url_vhost),
        cmocka_unit_test(test_url_percent),
        cmocka_unit_test(test_url_bad),
        cmocka_unit_test(test_url_tls_and_query),
        cmocka_unit_test(test_url_too_long),
        cmocka_unit_test(test_url_mask_agree),
    };
    return cmocka_run_group_tests_name("mask", tests, NULL, NULL);
}
