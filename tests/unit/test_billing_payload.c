/* test_billing_payload.c - the payload shared by the bundled billing events
 * (handlers/billing_payload.c): valid forms, each missing field, each wrong type. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "billing.h"

#define INV "0b1a5e2f-3c4d-4e5f-8a9b-0c1d2e3f4a5b"
#define SUB "6f1e2d3c-4b5a-4968-8776-655443322110"

static billing_payload_t P;
static char why[256];

/* Parses a JSON text (which must be valid JSON) with billing_payload_parse. */
static bool parse_text(const char *text)
{
    json_error_t jerr;
    json_t *doc = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    if (doc == NULL)
        fail_msg("test bug: '%s' is not JSON: %s", text, jerr.text);
    memset(&P, 0x5a, sizeof P);
    strcpy(why, "untouched");
    bool ok = billing_payload_parse(doc, &P, why, sizeof why);
    json_decref(doc);
    return ok;
}

static void accept(const char *text)
{
    if (!parse_text(text))
        fail_msg("rejected: %s (%s)", text, why);
}

/* Expects text to be rejected with a reason that names field. */
static void reject(const char *text, const char *field)
{
    if (parse_text(text))
        fail_msg("accepted: %s", text);
    if (strstr(why, field) == NULL)
        fail_msg("%s: reason '%s' does not name %s", text, why, field);
}

/* A payload with one field replaced (value NULL: left out). */
static const char *with(const char *field, const char *value)
{
    static char buf[512];
    static const char *const names[] = {"invoice_id", "subscription_id", "amount_cents",
                                        "currency"};
    static const char *const values[] = {"\"" INV "\"", "\"" SUB "\"", "1999", "\"EUR\""};
    size_t n = 0;
    n += (size_t)snprintf(buf + n, sizeof buf - n, "{");
    bool first = true;
    for (size_t i = 0; i < 4; i++) {
        const char *v = strcmp(names[i], field) == 0 ? value : values[i];
        if (v == NULL)
            continue;
        n +=
            (size_t)snprintf(buf + n, sizeof buf - n, "%s\"%s\":%s", first ? "" : ",", names[i], v);
        first = false;
    }
    snprintf(buf + n, sizeof buf - n, "}");
    return buf;
}

static void test_valid(void **state)
{
    (void)state;
    accept("{\"invoice_id\":\"" INV "\",\"subscription_id\":\"" SUB
           "\",\"amount_cents\":1999,\"currency\":\"EUR\"}");
    assert_string_equal(P.invoice_id, INV);
    assert_string_equal(P.subscription_id, SUB);
    assert_int_equal(P.amount_cents, 1999);
    assert_string_equal(P.currency, "EUR");

    /* zero is an amount */
    accept(with("amount_cents", "0"));
    assert_int_equal(P.amount_cents, 0);

    /* large amounts survive as 64-bit */
    accept(with("amount_cents", "9007199254740993"));
    assert_true(P.amount_cents == 9007199254740993LL);

    /* ids in other PostgreSQL forms are normalised */
    accept(with("invoice_id", "\"{0B1A5E2F3C4D4E5F8A9B0C1D2E3F4A5B}\""));
    assert_string_equal(P.invoice_id, INV);
    accept(with("subscription_id", "\"6F1E2D3C4B5A49688776655443322110\""));
    assert_string_equal(P.subscription_id, SUB);
}

static void test_extra_fields_ignored(void **state)
{
    (void)state;
    accept("{\"note\":\"hi\",\"invoice_id\":\"" INV "\",\"subscription_id\":\"" SUB
           "\",\"amount_cents\":5,\"currency\":\"USD\",\"nested\":{\"currency\":1},"
           "\"list\":[1,2],\"amount\":\"x\",\"Currency\":7}");
    assert_string_equal(P.invoice_id, INV);
    assert_string_equal(P.subscription_id, SUB);
    assert_int_equal(P.amount_cents, 5);
    assert_string_equal(P.currency, "USD");
}

static void test_missing_fields(void **state)
{
    (void)state;
    reject(with("invoice_id", NULL), "invoice_id");
    reject(with("subscription_id", NULL), "subscription_id");
    reject(with("amount_cents", NULL), "amount_cents");
    reject(with("currency", NULL), "currency");
    assert_non_null(strstr(why, "missing"));
    reject("{}", "invoice_id");
}

static void test_null_fields(void **state)
{
    (void)state;
    reject(with("invoice_id", "null"), "invoice_id");
    reject(with("subscription_id", "null"), "subscription_id");
    reject(with("amount_cents", "null"), "amount_cents");
    reject(with("currency", "null"), "currency");
}

static void test_bad_ids(void **state)
{
    (void)state;
    reject(with("invoice_id", "\"not-a-uuid\""), "invoice_id");
    reject(with("invoice_id", "\"\""), "invoice_id");
    reject(with("invoice_id", "\"0b1a5e2f-3c4d-4e5f-8a9b-0c1d2e3f4a5\""), "invoice_id");
    reject(with("invoice_id", "\"-0b1a5e2f-3c4d-4e5f-8a9b-0c1d2e3f4a5b\""), "invoice_id");
    reject(with("invoice_id", "42"), "invoice_id");
    reject(with("invoice_id", "[\"" INV "\"]"), "invoice_id");
    reject(with("invoice_id", "{\"id\":\"" INV "\"}"), "invoice_id");
    reject(with("invoice_id", "true"), "invoice_id");
    reject(with("subscription_id", "\"zzz\""), "subscription_id");
    reject(with("subscription_id", "123"), "subscription_id");
}

static void test_bad_amounts(void **state)
{
    (void)state;
    reject(with("amount_cents", "\"1999\""), "amount_cents"); /* a string */
    reject(with("amount_cents", "1.5"), "amount_cents");      /* a real */
    reject(with("amount_cents", "1999.0"), "amount_cents");   /* a real, even if whole */
    reject(with("amount_cents", "1e3"), "amount_cents");
    reject(with("amount_cents", "-1"), "amount_cents"); /* negative */
    reject(with("amount_cents", "-9223372036854775808"), "amount_cents");
    reject(with("amount_cents", "true"), "amount_cents");
    reject(with("amount_cents", "[1]"), "amount_cents");
    reject(with("amount_cents", "{}"), "amount_cents");
}

static void test_bad_currencies(void **state)
{
    (void)state;
    reject(with("currency", "\"usd\""), "currency");
    reject(with("currency", "\"Usd\""), "currency");
    reject(with("currency", "\"USd\""), "currency");
    reject(with("currency", "\"US\""), "currency");
    reject(with("currency", "\"USDX\""), "currency");
    reject(with("currency", "\"\""), "currency");
    reject(with("currency", "\"U$D\""), "currency");
    reject(with("currency", "\"US1\""), "currency");
    reject(with("currency", "\" US\""), "currency");
    reject(with("currency", "\"\\u00c9UR\""), "currency"); /* non-ASCII letter */
    reject(with("currency", "\"US\\u0000\""), "currency"); /* embedded NUL */
    reject(with("currency", "123"), "currency");
    reject(with("currency", "[\"USD\"]"), "currency");
    reject(with("currency", "true"), "currency");
    accept(with("currency", "\"JPY\""));
    assert_string_equal(P.currency, "JPY");
}

static void test_not_an_object(void **state)
{
    (void)state;
    static const char *const docs[] = {
        "[]", "[{\"invoice_id\":\"" INV "\"}]", "\"text\"", "42", "1.5", "true", "null"};
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++)
        reject(docs[i], "object");
    /* a NULL payload is not an object either */
    memset(&P, 0x5a, sizeof P);
    assert_false(billing_payload_parse(NULL, &P, why, sizeof why));
    assert_non_null(strstr(why, "object"));
}

static void test_first_bad_field_reported(void **state)
{
    (void)state;
    /* one reason, one line, within the buffer */
    reject("{\"invoice_id\":1,\"subscription_id\":2,\"amount_cents\":\"x\",\"currency\":4}",
           "invoice_id");
    assert_null(strchr(why, '\n'));
    char small[8];
    json_t *doc = json_loads("{}", 0, NULL);
    assert_false(billing_payload_parse(doc, &P, small, sizeof small));
    assert_int_equal(strlen(small), sizeof small - 1);
    json_decref(doc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_extra_fields_ignored),
        cmocka_unit_test(test_missing_fields),
        cmocka_unit_test(test_null_fields),
        cmocka_unit_test(test_bad_ids),
        cmocka_unit_test(test_bad_amounts),
        cmocka_unit_test(test_bad_currencies),
        cmocka_unit_test(test_not_an_object),
        cmocka_unit_test(test_first_bad_field_reported),
    };
    return cmocka_run_group_tests_name("billing_payload", tests, NULL, NULL);
}
