/* receipt_requested.c - receipt.requested records one receipt (it stands for "receipt e-mail
 * sent"). */
#include "billing.h"

#define SQL_RECEIPT                                                                                \
    "INSERT INTO billing.receipts (invoice_id, subscription_id, event_id) VALUES ($1, $2, $3)"

idem_outcome billing_receipt_requested(idem_event_t *ev, void *userdata)
{
    billing_payload_t p;
    char why[200];
    if (!billing_payload_parse(idem_event_payload(ev), &p, why, sizeof why))
        return idem_event_fail(ev, IDEM_INVALID, "%s", why);
    const char *params[] = {p.invoice_id, p.subscription_id, idem_event_id(ev)};
    return idem_event_exec(ev, SQL_RECEIPT, 3, params, NULL);
}
