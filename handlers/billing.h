/* billing.h - idem's bundled billing handlers: payment.failed advances dunning, invoice.paid
 * books revenue, resets dunning and asks for a receipt, receipt.requested sends it. Written only
 * against the public <idem/...> headers, as any user's handlers would be. */
#ifndef IDEM_BILLING_H
#define IDEM_BILLING_H

#include <stdbool.h>
#include <stddef.h>

#include <idem/idem.h>

/* The payload all three event types share. */
typedef struct billing_payload {
    char invoice_id[37];
    char subscription_id[37];
    long long amount_cents;
    char currency[4];
} billing_payload_t;

/* Validates payload (a JSON object): invoice_id and subscription_id UUID strings, amount_cents
 * an integer >= 0, currency three uppercase letters; extra fields are ignored. On failure
 * returns false and writes the reason to why. */
bool billing_payload_parse(const json_t *payload, billing_payload_t *out, char *why, size_t why_sz);

idem_outcome billing_payment_failed(idem_event_t *ev, void *userdata);
idem_outcome billing_invoice_paid(idem_event_t *ev, void *userdata);
idem_outcome billing_receipt_requested(idem_event_t *ev, void *userdata);

/* Registers the three handlers on c. 0 or a negative idem_status. */
int billing_register(idem_consumer_t *c);

#endif
