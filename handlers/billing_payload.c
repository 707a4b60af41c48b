/* billing_payload.c - the payload shared by the billing events. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "billing.h"

static bool uuid_field(const json_t *o, const char *name, char out[37], char *why, size_t sz)
{
    const json_t *v = json_object_get(o, name);
    if (v == NULL) {
        snprintf(why, sz, "%s: missing", name);
        return false;
    }
    if (!json_is_string(v) || !idem_uuid_normalize(json_string_value(v), out)) {
        snprintf(why, sz, "%s: not a UUID string", name);
        return false;
    }
    return true;
}

bool billing_payload_parse(const json_t *payload, billing_payload_t *out, char *why, size_t why_sz)
{
    memset(out, 0, sizeof *out);
    if (!json_is_object(payload)) {
        snprintf(why, why_sz, "payload is not a JSON object");
        return false;
    }
    if (!uuid_field(payload, "invoice_id", out->invoice_id, why, why_sz) ||
        !uuid_field(payload, "subscription_id", out->subscription_id, why, why_sz))
        return false;

    const json_t *amount = json_object_get(payload, "amount_cents");
    if (amount == NULL) {
        snprintf(why, why_sz, "amount_cents: missing");
        return false;
    }
    if (!json_is_integer(amount) || json_integer_value(amount) < 0) {
        snprintf(why, why_sz, "amount_cents: not an integer >= 0");
        return false;
    }
    out->amount_cents = json_integer_value(amount);

    const json_t *cur = json_object_get(payload, "currency");
    if (cur == NULL) {
        snprintf(why, why_sz, "currency: missing");
        return false;
    }
    const char *s = json_string_value(cur);
    if (s == NULL || json_string_length(cur) != 3 || !isupper((unsigned char)s[0]) ||
        !isupper((unsigned char)s[1]) || !isupper((unsigned char)s[2])) {
        snprintf(why, why_sz, "currency: not three uppercase letters");
        return false;
    }
    memcpy(out->currency, s, 4);
    return true;
}
