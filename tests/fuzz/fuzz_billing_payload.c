/* fuzz_billing_payload.c - libFuzzer target for the bundled handlers' payload parser
 * (handlers/billing_payload.c) behind jansson's decoder, with the consumer's decode flags.
 *
 * Checked beyond memory safety: an accepted payload has canonical lowercase UUIDs, an amount
 * >= 0 equal to the JSON integer, and a currency of three uppercase letters equal to the JSON
 * string; a rejected one has a NUL-terminated reason. */
#include <ctype.h>

#include <jansson.h>

#include "billing.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t why_sz = 1 + data[0] % 160;
    char *buf = fz_dup(data + 1, size - 1, 0);
    json_error_t jerr;
    json_t *doc = json_loadb(buf, size - 1, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (doc != NULL) {
        billing_payload_t p;
        char *why = malloc(why_sz);
        if (billing_payload_parse(doc, &p, why, why_sz)) {
            FZ_CHECK(json_is_object(doc), "a non-object accepted");
            FZ_CHECK(strlen(p.invoice_id) == 36 && strlen(p.subscription_id) == 36, "ids");
            for (int i = 0; i < 36; i++)
                FZ_CHECK(!isupper((unsigned char)p.invoice_id[i]) &&
                             !isupper((unsigned char)p.subscription_id[i]),
                         "not lowercase");
            FZ_CHECK(p.amount_cents >= 0, "amount %lld", p.amount_cents);
            FZ_CHECK(p.amount_cents == json_integer_value(json_object_get(doc, "amount_cents")),
                     "amount differs");
            FZ_CHECK(strlen(p.currency) == 3 && isupper((unsigned char)p.currency[0]) &&
                         isupper((unsigned char)p.currency[1]) &&
                         isupper((unsigned char)p.currency[2]),
                     "currency '%s'", p.currency);
            FZ_CHECK(strcmp(p.currency, json_string_value(json_object_get(doc, "currency"))) == 0,
                     "currency differs");
        } else {
            FZ_CHECK(memchr(why, '\0', why_sz) != NULL, "reason unterminated");
        }
        free(why);
        /* what the consumer hands on (receipt.requested's payload, SQL handlers' jsonb) */
        char *s = json_dumps(doc, JSON_COMPACT);
        if (s != NULL) {
            json_t *again = json_loads(s, JSON_DECODE_ANY, &jerr);
            FZ_CHECK(again != NULL, "own dump does not load again: %s", jerr.text);
            FZ_CHECK(json_equal(doc, again), "round trip changed the document");
            json_decref(again);
            free(s);
        }
        json_decref(doc);
    }
    free(buf);
    return 0;
}
