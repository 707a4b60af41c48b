/* billing.c - registers the bundled billing handlers. */
#include "billing.h"

/* Their tables are in schema billing, made by `idem migrate --billing`. */
#define BILLING_MIGRATION "billing/001_billing.sql"

int billing_register(idem_consumer_t *c)
{
    int rc = idem_consumer_require_migration(c, BILLING_MIGRATION);
    if (rc == IDEM_OK)
        rc = idem_consumer_register(c, "payment.failed", billing_payment_failed, NULL);
    if (rc == IDEM_OK)
        rc = idem_consumer_register(c, "invoice.paid", billing_invoice_paid, NULL);
    if (rc == IDEM_OK)
        rc = idem_consumer_register(c, "receipt.requested", billing_receipt_requested, NULL);
    return rc;
}
