/* billing.c - registers the bundled billing handlers. */
#include "billing.h"

int billing_register(idem_consumer_t *c)
{
    int rc = idem_consumer_register(c, "payment.failed", billing_payment_failed, NULL);
    if (rc == IDEM_OK)
        rc = idem_consumer_register(c, "invoice.paid", billing_invoice_paid, NULL);
    if (rc == IDEM_OK)
        rc = idem_consumer_register(c, "receipt.requested", billing_receipt_requested, NULL);
    return rc;
}
