/* invoice_paid.c - invoice.paid books one revenue entry, resets the subscription's dunning step
 * to 0 if it has a row (creates none), and emits receipt.requested (same payload) through the
 * outbox as its follow-up "receipt" (idem_emit_followup: dedup key "idem:<event id>:receipt", a
 * namespace no emitter can squat; a redelivered invoice.paid collapses). One statement, so all
 * three commit together with the claim, or not at all. */
#include <stdio.h>
#include <stdlib.h>

#include "billing.h"

#define SQL_INVOICE_PAID                                                                           \
    "WITH revenue AS ("                                                                            \
    "  INSERT INTO billing.revenue_entries (invoice_id, subscription_id, amount_cents, currency, " \
    "event_id)"                                                                                    \
    "  VALUES ($1, $2, $3, $4, $5)), "                                                             \
    "dunning_reset AS ("                                                                           \
    "  UPDATE billing.dunning SET step = 0, updated_at = now(), last_event_id = $5"                \
    "  WHERE subscription_id = $2) "                                                               \
    "SELECT idem.idem_emit_followup($5, 'receipt', 'receipt.requested', $2, $6::jsonb)"

idem_outcome billing_invoice_paid(idem_event_t *ev, void *userdata)
{
    billing_payload_t p;
    char why[200];
    if (!billing_payload_parse(idem_event_payload(ev), &p, why, sizeof why))
        return idem_event_fail(ev, IDEM_INVALID, "%s", why);
    char amount[24];
    snprintf(amount, sizeof amount, "%lld", p.amount_cents);
    char *payload = json_dumps(idem_event_payload(ev), JSON_COMPACT);
    if (payload == NULL)
        return idem_event_fail(ev, IDEM_RETRY, "out of memory");
    const char *params[] = {p.invoice_id, p.subscription_id, amount,
                            p.currency,   idem_event_id(ev), payload};
    idem_outcome o = idem_event_exec(ev, SQL_INVOICE_PAID, 6, params, NULL);
    free(payload);
    return o;
}
