/* test_fuzz_regressions.c - defects found by the fuzz targets (tests/fuzz) and the hostile input
 * corpus (tests/hostile), one case each, named after the corpus file that reproduces it; each
 * failed before its fix. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <jansson.h>

#include <idem/error.h>

#include "envelope.h"
#include "mask.h"
#include "rmq.h"
#include "rmq_int.h"

/* ---- masking: tests/fuzz/corpus/fuzz_amqp_url_mask/regress-* ------------------------------- */

static char out[1024];

static void expect_hidden(const char *in, const char *secret, bool line)
{
    memset(out, 'Z', sizeof out);
    if (line)
        idemp_mask_line(in, out, sizeof out);
    else
        idemp_mask_secrets(in, out, sizeof out);
    if (strstr(out, secret) != NULL)
        fail_msg("%s(\"%s\") = \"%s\" shows the secret \"%s\"",
                 line ? "idemp_mask_line" : "idemp_mask_secrets", in, out, secret);
}

/* regress-sslpassword: the contract names sslpassword among what masking covers */
static void test_sslpassword_masked(void **state)
{
    (void)state;
    expect_hidden("host=db sslpassword=hunter33 user=x", "hunter33", false);
    expect_hidden("postgresql://db/x?password=hunter22&sslpassword=hunter33", "hunter33", false);
    expect_hidden("host=db sslpassword = 'key pass' user=x", "key pass", false);
    expect_hidden("connect failed: host=db sslpassword=hunter33", "hunter33", true);
}

/* regress-blank_in_password: the URL parser accepts a blank (or a tab) in the password, and the
 * mask ends a URL's userinfo at a blank (test_mask.c, test_urls_without_password), so the rest
 * of the password is printed. Either the parser refuses such a URL, or the mask hides what the
 * parser takes for the password. */
static void expect_parsed_password_hidden(const char *url, const char *secret)
{
    idemp_amqp_url_t u;
    if (idemp_amqp_url_parse(url, &u) != IDEM_OK)
        return;
    expect_hidden(url, secret, false);
    char line[300];
    snprintf(line, sizeof line, "cannot connect to %s", url);
    expect_hidden(line, secret, true);
}

static void test_blank_in_url_password_masked(void **state)
{
    (void)state;
    expect_parsed_password_hidden("amqp://user:pass word@host/", "pass word");
    expect_parsed_password_hidden("amqp://user:pass word@host/", "word@");
    expect_parsed_password_hidden("amqp://user:pass\tword@host/", "word");
}

/* regress-blank_in_pg_uri_password: libpq takes a blank into a URI's password, and echoes the
 * URI in quotes in its parse errors */
static void test_blank_in_pg_uri_password_masked(void **state)
{
    (void)state;
    expect_hidden("postgresql://u:top secret@h/db", "secret", false);
    expect_hidden("in URI: \"postgresql://u:top secret@[::1/db\"", "secret", true);
}

/* regress-newline_after_password_equals: libpq skips any blank around '=' */
static void test_conninfo_blanks_around_equals(void **state)
{
    (void)state;
    expect_hidden("host=db password=\n hunter22 user=x", "hunter22", false);
    expect_hidden("host=db password\t=\thunter22 user=x", "hunter22", false);
    expect_hidden("host=db password =\vhunter22 user=x", "hunter22", true);
}

/* regress-ampersand_in_password, regress-escaped_blank_in_password: a keyword/value password
 * ends where libpq ends it */
static void test_conninfo_value_as_libpq_reads_it(void **state)
{
    (void)state;
    expect_hidden("host=db password=abc&hunter22 user=x", "hunter22", false);
    expect_hidden("host=db password=abc\\ hunter22 user=x", "hunter22", false);
    /* a URI's query value is raw: quotes are part of it */
    expect_hidden("postgresql://db/x?password='a'hunter22", "hunter22", false);
    /* in a URI's query '&' does end the value */
    expect_hidden("postgresql://db/x?password=hunter22&sslmode=require", "hunter22", false);
}

/* regress-url_inside_keyword_password: a URL-like value of a keyword/value conninfo whose '@'
 * lies inside a later password=...: masking up to that '@' left the rest of the password (libpq
 * reads it up to the blank) in clear */
static void test_url_inside_a_keyword_password(void **state)
{
    (void)state;
    expect_hidden("host=h options=x://u:pw password=secret@restofsecret", "restofsecret", false);
    expect_hidden("host=h options=x://u:pw password=secret@restofsecret user=u", "restofsecret",
                  false);
    expect_hidden("options=x://u:pw?a=b&password=s@cret&more sslpassword=k@eyhunter22&x dbname=d",
                  "hunter22", false);
}

/* An invalid URL is echoed in the error: no part of its password may show, whether a blank or a
 * ',' (which splits the list) cut it. */
static void expect_error_hides(const char *urls, const char *secret)
{
    idem_error_t err = {0};
    idemp_amqp_t *a = idemp_amqp_new(urls, "test", -1, &err);
    assert_null(a);
    if (strstr(err.text, secret) != NULL)
        fail_msg("idemp_amqp_new(\"%s\") fails with \"%s\", which shows \"%s\"", urls, err.text,
                 secret);
}

static void test_invalid_url_error_hides_password(void **state)
{
    (void)state;
    expect_error_hides("amqp://u:top secret@h:99999", "top");
    expect_error_hides("amqp://u:topsec,ret@h", "topsec");
    expect_error_hides("amqp://h1,amqp://u:topsec,ret@h2", "topsec");
}

/* regress-raw_blank_in_url: an AMQP URL with a raw blank, tab or non-ASCII byte is refused (RFC
 * 3986 has none), so no password the parser takes can end where the mask does not look */
static void test_url_with_raw_blank_refused(void **state)
{
    (void)state;
    static const char *const urls[] = {"amqp://a: sap H@h/", "amqp://u:pa\tss@h",
                                       "amqp://u:p\xc5\x9bss@h", "amqps://\t:qser@[::1]:5671/vh",
                                       "amqp://u:pass@h/v h"};
    for (size_t i = 0; i < sizeof urls / sizeof urls[0]; i++) {
        idemp_amqp_url_t u;
        if (idemp_amqp_url_parse(urls[i], &u) == IDEM_OK)
            fail_msg("\"%s\" accepted", urls[i]);
    }
}

/* regress-pg_uri_userinfo_*: libpq looks for a URI's '@' up to the first '/', past '?' and '#',
 * and takes a query value raw up to '&' ('#' included) */
static void test_pg_uri_userinfo_as_libpq_reads_it(void **state)
{
    (void)state;
    expect_hidden("postgresql://guest#app:hunter2#@db:5432/billing?sslmode=require", "hunter2",
                  false);
    expect_hidden("postgresql://:3?password:ph42x@h/db", "ph42x", false);
    expect_hidden("postgresql://u:pw@h?password=abc@hunter22", "hunter22", false);
    expect_hidden("postgresql://db/x?password=hcoH#dunins", "dunins", false);
    expect_hidden("cannot connect: postgresql://db/x?password=hcoH#dunins", "dunins", true);
    /* an '@' inside a query's password value of a URI without userinfo */
    expect_hidden("postgresql://:b/xrd=hunter2)@h2/mo?password=hunter21@h2/mo(+equi", "h2/mo(+",
                  false);
    expect_hidden("postgresql://db/d=x)@o://[?password=0dpsecret::p21@h2/mo(+equi", "0dpsecret",
                  false);
    /* the keyword inside the userinfo's password: that password is '?password=hunter2h' */
    expect_hidden("postgresql://d:?password=hunter2h@12/db", "?password=hunter2h", false);
    expect_hidden("postgresql://d:?password=hunter2h@12/db", "hunter2h", false);
}

/* ---- the event type: tests/hostile/properties-type_with_nul.json --------------------------- */

static void test_type_with_nul_is_not_the_type_before_it(void **state)
{
    (void)state;
    static const char type[] = "payment.failed\0x";
    static const char body[] = "{}";
    idemp_envelope_in_t in;
    memset(&in, 0, sizeof in);
    in.message_id = (idemp_str_t){"6f1c2a9e-3b7d-4c1e-9a2f-0d5e8b7c6a41", 36};
    in.type = (idemp_str_t){type, sizeof type - 1};
    in.body = body;
    in.body_len = 2;
    in.body_size = 2;
    idemp_envelope_t env;
    char detail[256];
    idemp_dl_code code = idemp_envelope_parse(&in, 1048576, 0, &env, detail, sizeof detail);
    if (code == IDEMP_DL_NONE) {
        json_decref(env.payload);
        /* accepted: then the type must be the whole type, not what precedes the NUL */
        if (strcmp(env.event_type, "payment.failed") == 0)
            fail_msg("type \"payment.failed\\0x\" accepted as \"payment.failed\"");
    } else {
        assert_int_equal(code, IDEMP_DL_UNKNOWN_TYPE);
    }
}

/* ---- headers for SQL handlers: tests/fuzz/corpus/fuzz_props_envelope/regress-headers_json_* --
 * jansson's allocations are tracked: a block freed twice is a failure, in any build. */

#define MAX_LIVE 4096
static struct {
    void *p;
    size_t n;
} live[MAX_LIVE];
static int double_frees;

static void *track_malloc(size_t n)
{
    void *p = malloc(n);
    for (int i = 0; p != NULL && i < MAX_LIVE; i++)
        if (live[i].p == NULL) {
            live[i].p = p;
            live[i].n = n;
            return p;
        }
    return p;
}

/* A block freed is kept as it was until the test ends (graveyard_empty), its reference count
 * set to 1, so that a second json_decref of it frees it again, which counts. */
static void *graveyard[MAX_LIVE];
static int buried;

static void track_free(void *p)
{
    if (p == NULL)
        return;
    for (int i = 0; i < MAX_LIVE; i++)
        if (live[i].p == p) {
            if (live[i].n >= sizeof(json_t))
                ((json_t *)p)->refcount = 1;
            live[i].p = NULL;
            if (buried < MAX_LIVE)
                graveyard[buried++] = p;
            return;
        }
    double_frees++;
}

/* Gives back the blocks freed (kept above); the live ones stay their owners' to free. */
static void graveyard_empty(void)
{
    for (int i = 0; i < buried; i++)
        free(graveyard[i]);
    buried = 0;
    memset(live, 0, sizeof live);
}

static idemp_msg_t *msg_with_header(const char *k, size_t klen, const char *v, size_t vlen)
{
    static char kbuf[64], vbuf[64];
    memcpy(kbuf, k, klen);
    memcpy(vbuf, v, vlen);
    amqp_bytes_t key = {klen, kbuf}, value = {vlen, vbuf};
    static amqp_table_entry_t e;
    idemp_msg_t *m = calloc(1, sizeof *m);
    assert_non_null(m);
    init_amqp_pool(&m->pool, 1024);
    e.key = key;
    e.value.kind = AMQP_FIELD_KIND_UTF8;
    e.value.value.bytes = value;
    m->props._flags = AMQP_BASIC_HEADERS_FLAG;
    m->props.headers.num_entries = 1;
    m->props.headers.entries = &e;
    return m;
}

/* regress-headers_json_nonutf8_key: json_object_set_new already drops the value it refuses */
static void test_headers_json_nonutf8_key_freed_once(void **state)
{
    (void)state;
    json_set_alloc_funcs(track_malloc, track_free);
    double_frees = 0;
    idemp_msg_t *m = msg_with_header("\xfftrace", 6, "v", 1);
    char *s = idemp_msg_headers_json(m);
    json_set_alloc_funcs(malloc, free);
    graveyard_empty();
    idemp_msg_free(m);
    assert_int_equal(double_frees, 0);
    assert_non_null(s);
    free(s);
}

/* regress-headers_json_nul_value: what SQL handlers get must be jsonb PostgreSQL accepts, which
 * has no \u0000 */
static void test_headers_json_nul_value_is_valid_jsonb(void **state)
{
    (void)state;
    idemp_msg_t *m = msg_with_header("trace", 5, "a\0b", 3);
    char *s = idemp_msg_headers_json(m);
    idemp_msg_free(m);
    assert_non_null(s);
    if (strstr(s, "\\u0000") != NULL)
        fail_msg("headers JSON %s holds \\u0000, which jsonb refuses (SQLSTATE 22P05)", s);
    free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sslpassword_masked),
        cmocka_unit_test(test_url_inside_a_keyword_password),
        cmocka_unit_test(test_blank_in_url_password_masked),
        cmocka_unit_test(test_blank_in_pg_uri_password_masked),
        cmocka_unit_test(test_conninfo_blanks_around_equals),
        cmocka_unit_test(test_conninfo_value_as_libpq_reads_it),
        cmocka_unit_test(test_invalid_url_error_hides_password),
        cmocka_unit_test(test_url_with_raw_blank_refused),
        cmocka_unit_test(test_pg_uri_userinfo_as_libpq_reads_it),
        cmocka_unit_test(test_type_with_nul_is_not_the_type_before_it),
        cmocka_unit_test(test_headers_json_nonutf8_key_freed_once),
        cmocka_unit_test(test_headers_json_nul_value_is_valid_jsonb),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
