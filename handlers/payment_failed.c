/* payment_failed.c - payment.failed advances the subscription's dunning step by one (the row is
 * created at step 1). Exactly once per event: the runtime has claimed the event id in the same
 * transaction. */
#include "billing.h"

#define SQL_ADVANCE_DUNNING                                                                        \
    "INSERT INTO billing.dunning AS d (subscription_id, step, last_event_id) VALUES ($1, 1, $2) "  \
    "ON CONFLICT (subscription_id) DO UPDATE "                                                     \
    "SET step = d.step + 1, updated_at = now(), last_event_id = EXCLUDED.last_event_id"

idem_outcome billing_payment_failed(idem_event_t *ev, void *userdata)
{
    billing_payload_t p;
    char why[200];
    if (!billing_payload_parse(idem_event_payload(ev), &p, why, sizeof why))
        return idem_event_fail(ev, IDEM_INVALID, "%s", why);
    const char *params[] = {p.subscription_id, idem_event_id(ev)};
    return idem_event_exec(ev, SQL_ADVANCE_DUNNING, 2, params, NULL);
}
