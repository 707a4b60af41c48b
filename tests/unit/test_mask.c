/* test_mask.c - password masking and "host:port" for messages (src/util/mask.c), and the AMQP URL
 * parser (src/adapters/rmq/rmq.c) whose passwords the masking must hide. */
#include <ctype.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <libpq-fe.h>

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

static void test_sslpassword_and_any_case(void **state)
{
    (void)state;
    /* libpq's sslpassword (the client key's passphrase) is a secret too */
    expect_mask("host=x sslpassword=secret sslkey=/k", "host=x sslpassword=*** sslkey=/k");
    expect_mask("sslpassword = 'a b' port=1", "sslpassword=*** port=1");
    expect_mask("postgresql://h/db?sslpassword=s%20t&sslmode=require",
                "postgresql://h/db?sslpassword=***&sslmode=require");
    expect_mask("PASSWORD=x Password='y z' port=1", "PASSWORD=*** Password=*** port=1");
    expect_mask("my_password=abc", "my_password=abc");
}

static void test_conninfo_bare_values(void **state)
{
    (void)state;
    /* a bare value ends at whitespace that no backslash escapes, as libpq reads it; '&' is part
     * of it (only a URI's query splits on '&') */
    expect_mask("password=a\\ b user=y", "password=*** user=y");
    expect_mask("password=a\\\\ user=y", "password=*** user=y");
    expect_mask("password=a&b user=y", "password=*** user=y");
    expect_mask("password=a#b?c=d user=y", "password=*** user=y");
    expect_mask("password=\\'quote user=y", "password=*** user=y");
}

static void test_urls_with_unencoded_characters(void **state)
{
    (void)state;
    /* an unencoded '/', '?' or '#' makes the URL invalid, and the error prints it as given */
    expect_mask("invalid AMQP URL: amqp://u:pa/ss@h:5672", "invalid AMQP URL: amqp://u:***@h:5672");
    expect_mask("amqp://u:pa?ss@h/vh", "amqp://u:***@h/vh");
    expect_mask("amqp://u:pa#ss@h", "amqp://u:***@h");
    /* and a space: the URL runs on to its last '@' */
    expect_mask("invalid AMQP URL: amqp://u:pa ss/x@h:99999",
                "invalid AMQP URL: amqp://u:***@h:99999");
    expect_mask("amqp://u:pa ss@h1, amqp://v:w@h2", "amqp://u:***@h1, amqp://v:***@h2");
    expect_mask("amqp://u:a/b@h1,amqp://u:c#d@h2:5672/v", "amqp://u:***@h1,amqp://u:***@h2:5672/v");
    /* an unencoded ':' or '@' (the AMQP parser takes the last '@') */
    expect_mask("amqp://u:p:a@s@s@h/", "amqp://u:***@h/");
    /* a list: each URL on its own */
    expect_mask("amqp://a:one@h1:5672,amqp://b:two@h2,amqps://h3:5671",
                "amqp://a:***@h1:5672,amqp://b:***@h2,amqps://h3:5671");
    /* host:port lists, IPv6 and '@' further on are no userinfo */
    expect_mask("postgresql://h1:5432,[::1]:5433/db?sslrootcert=/x@y/ca.pem",
                "postgresql://h1:5432,[::1]:5433/db?sslrootcert=/x@y/ca.pem");
}

static void test_libpq_messages(void **state)
{
    (void)state;
    /* libpq quotes an undecodable URI token: a password with a bare '%' */
    expect_mask(
        "cannot connect to PostgreSQL at db:5432: invalid percent-encoded token: \"50%off\"",
        "cannot connect to PostgreSQL at db:5432: invalid percent-encoded token: \"***\"");
    expect_mask("forbidden value %00 in percent-encoded value: \"a%00b\"",
                "forbidden value %00 in percent-encoded value: \"***\"");
    /* a password with a bare '/' becomes libpq's port */
    expect_mask("invalid integer value \"pa\" for connection option \"port\"",
                "invalid integer value \"***\" for connection option \"port\"");
    expect_mask("invalid integer value \"x\" for connection option \"connect_timeout\"",
                "invalid integer value \"x\" for connection option \"connect_timeout\"");
    /* a password with a bare '@': libpq takes the first '@', the rest becomes the host */
    expect_mask("could not translate host name \"ss@127.0.0.1\" to address: Name or service",
                "could not translate host name \"***@127.0.0.1\" to address: Name or service");
    expect_mask("could not translate host name \"db.example\" to address: Name or service",
                "could not translate host name \"db.example\" to address: Name or service");
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

static void test_where_unencoded_password(void **state)
{
    (void)state;
    /* libpq misreads a URI whose password holds a bare '/', '@' or '%': the server named in
     * messages comes from the URI without its userinfo, never from a piece of the password */
    expect_where("postgresql://u:pa/ss@127.0.0.1:1/x", "127.0.0.1:1");
    expect_where("postgresql://u:pa@ss@127.0.0.1:1/x", "127.0.0.1:1");
    expect_where("postgresql://u:50%off@db:5433/x", "db:5433");
    expect_where("postgres://u:pa%zz@db/x?sslmode=require", "db:5432");
    expect_where("postgresql://h1:5432,h2:5433/db", "h1:5432,h2:5433");
    /* "://" in the password: libpq would take its second half for the host */
    expect_where("postgresql://u:pa@ss://word@127.0.0.1:1/x", "127.0.0.1:1");
    expect_where("postgresql://u:pa://ss@127.0.0.1:1/x", "127.0.0.1:1");
}

static void test_uri_ambiguous(void **state)
{
    (void)state;
    assert_true(idemp_pg_uri_ambiguous("postgresql://u:pa://ss@h:1/x"));
    assert_true(idemp_pg_uri_ambiguous("postgres://u:pa@ss://word@h/x"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u:pa/ss@h/x?sslmode=require"));
    assert_false(idemp_pg_uri_ambiguous("postgresql://u:p@ss@h:1/x"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u@h/x?password=a://b@c"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u:p@q://d?password=@"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u@h/x?password=a:/b@c"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u:d@h=p/db?password=x@y"));
    assert_false(idemp_pg_uri_ambiguous("postgresql://h/x?password=a:/b@c"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u:p@h?password=abc@hunter22"));
    assert_true(idemp_pg_uri_ambiguous("postgresql://u:d@h?password=hu@"));
    assert_false(idemp_pg_uri_ambiguous("postgresql://h?password=abc@hunter22"));
    assert_false(idemp_pg_uri_ambiguous("postgresql://u:p@h/db"));
    assert_false(idemp_pg_uri_ambiguous("host=h password=a://b@c"));
    assert_false(idemp_pg_uri_ambiguous(""));
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

static void unparsed(const char *in, const char *want)
{
    char got[256];
    idemp_mask_unparsed_url(in, got, sizeof got);
    assert_string_equal(got, want);
}

/* A URL that did not parse shows nothing before its last '@' after the scheme. */
static void test_unparsed_url(void **state)
{
    (void)state;
    unparsed("amqp://user:pa://ss@host:5672/", "amqp://***@host:5672/");
    unparsed("amqp://u:x@h:1,amqp://user:a://b,c@host:5672/", "amqp://***@host:5672/");
    unparsed("amqp://user:a@b://c@h", "amqp://***@h");
    unparsed("user:secret@h", "***@h");
    unparsed("amqp://h:0", "amqp://h:0");
    unparsed("", "");
    char small[8];
    idemp_mask_unparsed_url("amqp://u:secret@h", small, sizeof small);
    assert_string_equal(small, "amqp://");
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

/* ---- generated: 10,000 URLs, lists and conninfo strings with random passwords ---- */

/* Every generated string is masked and compared with the exact expected text: the password
 * replaced by "***" and everything else kept. The password (raw and as written) must not appear
 * in the output. What the generator writes is checked against the parsers too: idem's AMQP URL
 * parser and libpq's conninfo parser must read back the same password, so the cases are strings
 * that real configurations can hold. */

#define GEN_CASES 10000

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;

static uint64_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ULL;
}

static size_t below(size_t n)
{
    return (size_t)(rnd() % n);
}

static bool chance(int percent)
{
    return below(100) < (size_t)percent;
}

typedef struct {
    char s[4096];
    size_t n;
} buf_t;

static void b_putc(buf_t *b, char c)
{
    assert_true(b->n + 1 < sizeof b->s);
    b->s[b->n++] = c;
    b->s[b->n] = '\0';
}

static void b_puts(buf_t *b, const char *s)
{
    while (*s)
        b_putc(b, *s++);
}

static void b_printf(buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->s + b->n, sizeof b->s - b->n, fmt, ap);
    va_end(ap);
    assert_true(n >= 0 && (size_t)n < sizeof b->s - b->n);
    b->n += (size_t)n;
}

/* Both the generated text and what masking must make of it. */
typedef struct {
    buf_t in, want;
    char secrets[8][128]; /* raw passwords */
    char written[8][400]; /* as they appear in the input (escaped or quoted) */
    int nsecrets;
} gcase_t;

static void both(gcase_t *c, const char *s)
{
    b_puts(&c->in, s);
    b_puts(&c->want, s);
}

/* A password: 1-40 bytes of 1..255, often the characters that break naive parsers. */
static void gen_password(char *pw, size_t *len)
{
    static const char special[] = "/@:%'\" \\&=?#,+;$!*()~[]{}<>|^`\t\n\r";
    size_t n = 1 + below(40);
    for (size_t i = 0; i < n; i++)
        pw[i] = chance(45) ? special[below(sizeof special - 1)] : (char)(1 + below(255));
    pw[n] = '\0';
    *len = n;
}

static bool unreserved(unsigned char ch)
{
    return isalnum(ch) || strchr("-._~", ch) != NULL;
}

/* Percent-encodes s for a URL's userinfo (user or password: sub-delims and, in the password,
 * ':' may stay raw; raw_at: an '@' too, which the AMQP parser allows as it takes the last one);
 * list: a ',' must be encoded (the URL list is split on commas first). */
static void url_encode(buf_t *b, const char *s, bool password, bool raw_at, bool list)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        bool may_stay = unreserved(ch) || (ch != 0 && strchr("!$&'()*+;=", ch) != NULL) ||
                        (ch == ',' && !list) || (password && ch == ':') || (raw_at && ch == '@');
        if (may_stay && chance(80))
            b_putc(b, (char)ch);
        else
            b_printf(b, chance(50) ? "%%%02X" : "%%%02x", ch);
    }
}

/* Percent-encodes s for a URI query value (what libpq decodes there). An '@' is encoded: in a
 * URI without a path libpq would take "host?password=a@" for a user name. */
static void query_encode(buf_t *b, const char *s)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if ((unreserved(ch) || (ch != 0 && strchr("!$'()*,;:/", ch) != NULL)) && chance(80))
            b_putc(b, (char)ch);
        else
            b_printf(b, chance(50) ? "%%%02X" : "%%%02x", ch);
    }
}

static void add_secret(gcase_t *c, const char *pw, const char *written)
{
    assert_true(c->nsecrets < 8);
    snprintf(c->secrets[c->nsecrets], sizeof c->secrets[0], "%s", pw);
    snprintf(c->written[c->nsecrets], sizeof c->written[0], "%s", written);
    c->nsecrets++;
}

static const char *const HOSTS[] = {"h",         "rabbit.example.com", "10.1.2.3", "[::1]",
                                    "[fe80::1]", "mq-1.internal",      "localhost"};

static void gen_host(buf_t *b)
{
    b_puts(b, HOSTS[below(sizeof HOSTS / sizeof HOSTS[0])]);
    if (chance(60))
        b_printf(b, ":%u", (unsigned)(1 + below(65535)));
}

/* One amqp[s]:// URL. With a password (usually) it is checked against idem's parser. */
static void gen_amqp_url(gcase_t *c, bool list)
{
    const char *scheme = chance(50) ? "amqp" : "amqps";
    size_t url_start = c->in.n;
    both(c, scheme);
    both(c, "://");
    int kind = (int)below(10); /* 0: no userinfo, 1: user only, else user:password */
    buf_t user = {{0}, 0};
    static const char *const users[] = {"guest", "idem_relay", "app", "u", "a b", "x@y", "p:q"};
    if (kind >= 1) {
        url_encode(&user, users[below(sizeof users / sizeof users[0])], false, false, list);
        both(c, user.s);
    }
    char pw[64];
    size_t pwlen = 0;
    buf_t enc = {{0}, 0};
    if (kind >= 2) {
        gen_password(pw, &pwlen);
        url_encode(&enc, pw, true, chance(30), list);
        b_putc(&c->in, ':');
        b_puts(&c->in, enc.s);
        b_puts(&c->want, ":***");
        add_secret(c, pw, enc.s);
    }
    if (kind >= 1)
        both(c, "@");
    buf_t rest = {{0}, 0};
    gen_host(&rest);
    if (chance(50)) {
        static const char *const vhosts[] = {"/",        "/%2f",        "/%2F",
                                             "/billing", "/my%20vhost", "/v%40h"};
        b_puts(&rest, vhosts[below(sizeof vhosts / sizeof vhosts[0])]);
    }
    if (chance(40)) {
        static const char *const qs[] = {"cacertfile=/etc/idem/mq-ca.pem",
                                         "certfile=/etc/idem/client.pem",
                                         "keyfile=/etc/idem/client.key",
                                         "verify=verify_peer",
                                         "verify=verify_none",
                                         "heartbeat=10",
                                         "server_name_indication=broker.example"};
        b_putc(&rest, '?');
        for (size_t k = 0, n = 1 + below(3); k < n; k++) {
            if (k > 0)
                b_putc(&rest, '&');
            b_puts(&rest, qs[below(sizeof qs / sizeof qs[0])]);
        }
    }
    both(c, rest.s);
    /* what the parser reads from this URL alone */
    const char *url = c->in.s + url_start;
    idemp_amqp_url_t u;
    if (idemp_amqp_url_parse(url, &u) != IDEM_OK)
        fail_msg("generated an AMQP URL the parser refuses: %s", url);
    if (kind >= 2 && strcmp(u.password, pw) != 0)
        fail_msg("generated URL %s: the parser reads another password", url);
}

/* A libpq URI: postgresql://[user[:password]@]host[:port][,host[:port]...][/db][?params]. */
static void gen_pg_uri(gcase_t *c)
{
    both(c, chance(50) ? "postgresql://" : "postgres://");
    int kind = (int)below(10);
    char pw[64];
    size_t pwlen;
    if (kind >= 1) {
        buf_t user = {{0}, 0};
        url_encode(&user, chance(50) ? "app" : "billing user", false, false, false);
        both(c, user.s);
    }
    if (kind >= 3) {
        gen_password(pw, &pwlen);
        buf_t enc = {{0}, 0};
        url_encode(&enc, pw, true, false, false);
        b_putc(&c->in, ':');
        b_puts(&c->in, enc.s);
        b_puts(&c->want, ":***");
        add_secret(c, pw, enc.s);
    }
    if (kind >= 1)
        both(c, "@");
    for (size_t k = 0, n = 1 + below(3); k < n; k++) {
        if (k > 0)
            both(c, ",");
        static const char *const hs[] = {"db1", "10.0.0.5", "db.example.com", "[::1]"};
        both(c, hs[below(4)]);
        if (chance(60)) {
            char port[16];
            snprintf(port, sizeof port, ":%u", (unsigned)(1024 + below(60000)));
            both(c, port);
        }
    }
    if (chance(70))
        both(c, chance(50) ? "/billing" : "/db%2Dx");
    if (chance(60)) {
        static const char *const ps[] = {"sslmode=verify-full",
                                         "sslrootcert=/etc/idem/db-ca.pem",
                                         "target_session_attrs=read-write",
                                         "application_name=idem",
                                         "connect_timeout=10",
                                         "PASSWORD",
                                         "SSLPASSWORD"};
        both(c, "?");
        for (size_t k = 0, n = 1 + below(4); k < n; k++) {
            if (k > 0)
                both(c, "&");
            const char *p = ps[below(sizeof ps / sizeof ps[0])];
            if (strcmp(p, "PASSWORD") == 0 || strcmp(p, "SSLPASSWORD") == 0) {
                const char *kw = p[0] == 'P' ? "password" : "sslpassword";
                both(c, kw);
                char qpw[64];
                gen_password(qpw, &pwlen);
                buf_t enc = {{0}, 0};
                query_encode(&enc, qpw);
                b_putc(&c->in, '=');
                b_puts(&c->in, enc.s);
                b_puts(&c->want, "=***");
                add_secret(c, qpw, enc.s);
            } else {
                both(c, p);
            }
        }
    }
}

/* A key/value conninfo value of another keyword: a plain word or a quoted phrase. */
static void plain_value(gcase_t *c)
{
    static const char *const vs[] = {
        "db1",      "10.0.0.5",         "5432", "billing",    "verify-full", "/etc/idem/db-ca.pem",
        "'my app'", "'two words here'", "''",   "read-write", "'it\\'s'",    "a\\ b"};
    both(c, vs[below(sizeof vs / sizeof vs[0])]);
}

/* A password as a conninfo value: quoted ('...' with \' and \\) or bare (whitespace, quotes and
 * backslashes escaped with a backslash). */
static void conninfo_secret(gcase_t *c, const char *kw)
{
    char pw[64];
    size_t pwlen;
    gen_password(pw, &pwlen);
    both(c, "");
    b_puts(&c->in, kw);
    b_puts(&c->want, kw);
    if (chance(30))
        b_puts(&c->in, chance(50) ? " " : "  ");
    b_putc(&c->in, '=');
    b_puts(&c->want, "=***");
    if (chance(30))
        b_putc(&c->in, ' ');
    buf_t w = {{0}, 0};
    bool quoted = chance(50);
    if (quoted)
        b_putc(&w, '\'');
    for (size_t i = 0; i < pwlen; i++) {
        unsigned char ch = (unsigned char)pw[i];
        bool esc = quoted ? (ch == '\'' || ch == '\\')
                          : (ch == '\'' || ch == '\\' || isspace(ch) || (i == 0 && ch == '"'));
        if (esc || (!quoted && chance(5)))
            b_putc(&w, '\\');
        b_putc(&w, (char)ch);
    }
    if (quoted)
        b_putc(&w, '\'');
    b_puts(&c->in, w.s);
    add_secret(c, pw, w.s);
}

static void gen_conninfo(gcase_t *c)
{
    static const char *const kws[] = {"host",        "port",    "dbname",
                                      "user",        "sslmode", "application_name",
                                      "sslrootcert", "PW",      "SSLPW"};
    size_t n = 1 + below(6);
    bool any = false;
    for (size_t k = 0; k < n || !any; k++) {
        if (k > 0)
            both(c, chance(80) ? " " : "   ");
        const char *kw = kws[below(sizeof kws / sizeof kws[0])];
        if (k + 1 >= n && !any)
            kw = "PW";
        if (strcmp(kw, "PW") == 0 || strcmp(kw, "SSLPW") == 0) {
            conninfo_secret(c, kw[0] == 'P' ? "password" : "sslpassword");
            any = true;
        } else {
            both(c, kw);
            both(c, "=");
            plain_value(c);
        }
    }
}

/* libpq's message for a password with a '%' that is not an escape, as idem prints it. */
static void gen_libpq_message(gcase_t *c)
{
    char pw[64];
    size_t pwlen;
    gen_password(pw, &pwlen);
    for (size_t i = 0; i < pwlen; i++)
        if (pw[i] == '"' || pw[i] == '\n' || pw[i] == '\r' || pw[i] == '\t')
            pw[i] = '%';
    both(c, "idem status: cannot connect to PostgreSQL at db1:5432: ");
    both(c, chance(50) ? "invalid percent-encoded token: \""
                       : "forbidden value %00 in percent-encoded value: \"");
    b_puts(&c->in, pw);
    b_puts(&c->want, "***");
    both(c, "\"");
    add_secret(c, pw, pw);
}

/* libpq must read each generated conninfo (URI or key/value) with the generated passwords. */
static void check_libpq_reads(const char *conninfo, const gcase_t *c)
{
    char *errmsg = NULL;
    PQconninfoOption *opts = PQconninfoParse(conninfo, &errmsg);
    if (opts == NULL)
        fail_msg("generated a conninfo libpq refuses (%s): %s", errmsg ? errmsg : "?", conninfo);
    int found = 0;
    for (PQconninfoOption *o = opts; o->keyword; o++) {
        if ((strcmp(o->keyword, "password") == 0 || strcmp(o->keyword, "sslpassword") == 0) &&
            o->val != NULL) {
            for (int k = 0; k < c->nsecrets; k++)
                if (strcmp(o->val, c->secrets[k]) == 0)
                    found++;
        }
    }
    PQconninfoFree(opts);
    if (c->nsecrets > 0 && found == 0)
        fail_msg("libpq reads none of the generated passwords from: %s", conninfo);
}

static const char *const PREFIXES[] = {
    "", "cannot connect to ", "invalid AMQP URL: ", "connecting to \"", "url=", "("};
static const char *const SUFFIXES[] = {"", " failed", ": Connection refused", " (tls=on)",
                                       " and more text"};

static void expect_case(const gcase_t *c, const char *what)
{
    static char got[8192];
    memset(got, 'Z', sizeof got);
    idemp_mask_secrets(c->in.s, got, sizeof got);
    if (strcmp(got, c->want.s) != 0)
        fail_msg("%s\n  input %s\n  got   %s\n  want  %s", what, c->in.s, got, c->want.s);
    for (int k = 0; k < c->nsecrets; k++) {
        const char *forms[] = {c->secrets[k], c->written[k]};
        for (int f = 0; f < 2; f++)
            if (strlen(forms[f]) >= 4 && strstr(c->want.s, forms[f]) == NULL &&
                strstr(got, forms[f]) != NULL)
                fail_msg("%s: password shown\n  input %s\n  got   %s", what, c->in.s, got);
    }
}

static void test_generated(void **state)
{
    (void)state;
    static gcase_t c;
    int counts[5] = {0};
    /* a fixed seed, so a failure repeats; IDEM_MASK_SEED=N explores others */
    const char *seed = getenv("IDEM_MASK_SEED");
    if (seed != NULL && *seed != '\0')
        rng_state = strtoull(seed, NULL, 10) | 1;
    for (int n = 0; n < GEN_CASES; n++) {
        memset(&c, 0, sizeof c);
        int kind = (int)below(5);
        counts[kind]++;
        bool message = kind != 4 && chance(40);
        const char *pre = message ? PREFIXES[below(sizeof PREFIXES / sizeof PREFIXES[0])] : "";
        both(&c, pre);
        size_t start = c.in.n;
        switch (kind) {
        case 0: /* one AMQP URL */
            gen_amqp_url(&c, false);
            break;
        case 1: /* a comma-separated list of AMQP URLs (the nodes of a cluster) */
            for (size_t k = 0, m = 2 + below(3); k < m; k++) {
                if (k > 0)
                    both(&c, chance(80) ? "," : ", ");
                gen_amqp_url(&c, true);
            }
            break;
        case 2: /* a libpq URI, maybe multi-host, maybe with password= in the query */
            gen_pg_uri(&c);
            check_libpq_reads(c.in.s + start, &c);
            break;
        case 3: /* a key/value conninfo */
            gen_conninfo(&c);
            check_libpq_reads(c.in.s + start, &c);
            break;
        default:
            gen_libpq_message(&c);
            break;
        }
        if (message) {
            /* a bare conninfo or query value runs to the next whitespace */
            const char *suf = SUFFIXES[below(sizeof SUFFIXES / sizeof SUFFIXES[0])];
            both(&c, (kind == 2 || kind == 3) && *suf != ' ' ? "" : suf);
        }
        char what[64];
        snprintf(what, sizeof what, "case %d (kind %d)", n, kind);
        expect_case(&c, what);
    }
    for (int k = 0; k < 5; k++)
        assert_true(counts[k] > GEN_CASES / 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_urls),
        cmocka_unit_test(test_unparsed_url),
        cmocka_unit_test(test_urls_without_password),
        cmocka_unit_test(test_conninfo),
        cmocka_unit_test(test_conninfo_not_a_keyword),
        cmocka_unit_test(test_sslpassword_and_any_case),
        cmocka_unit_test(test_conninfo_bare_values),
        cmocka_unit_test(test_urls_with_unencoded_characters),
        cmocka_unit_test(test_libpq_messages),
        cmocka_unit_test(test_no_secret_survives),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_long_input),
        cmocka_unit_test_setup(test_where_uri, clear_pgenv),
        cmocka_unit_test_setup(test_where_keyvalue, clear_pgenv),
        cmocka_unit_test_setup(test_where_env, clear_pgenv),
        cmocka_unit_test_setup(test_where_unencoded_password, clear_pgenv),
        cmocka_unit_test(test_uri_ambiguous),
        cmocka_unit_test_setup(test_where_truncates, clear_pgenv),
        cmocka_unit_test(test_url_defaults),
        cmocka_unit_test(test_url_full),
        cmocka_unit_test(test_url_vhost),
        cmocka_unit_test(test_url_percent),
        cmocka_unit_test(test_url_bad),
        cmocka_unit_test(test_url_tls_and_query),
        cmocka_unit_test(test_url_too_long),
        cmocka_unit_test(test_url_mask_agree),
        cmocka_unit_test(test_generated),
    };
    return cmocka_run_group_tests_name("mask", tests, NULL, NULL);
}
