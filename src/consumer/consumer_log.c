/* consumer_log.c - the consumer's log lines, with the consumer, the queue and (for a delivery) its
 * event_id and event_type; every file of the consumer logs through it. */
#include <stdarg.h>
#include <stdlib.h>

#include <idem/log.h>

#include "consumer_int.h"
#include "mask.h"

static const char *const LOGC = "consumer";

void idemp_consumer_log(idem_log_level lvl, const idem_consumer_t *c, const delivery_t *d,
                        const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *msg = idemp_vformat(fmt, ap);
    va_end(ap);
    const char *kv[] = {"consumer",   c->consumer,
                        "queue",      c->queue,
                        "event_id",   d != NULL && d->ev.event_id[0] ? d->ev.event_id : NULL,
                        "event_type", d != NULL && d->ev.event_type[0] ? d->ev.event_type : NULL,
                        NULL};
    idem_log(lvl, LOGC, kv, "%s", msg ? msg : "out of memory");
    free(msg);
}
