/* event.h - the object a handler receives (opaque in the public API). */
#ifndef IDEM_EVENT_H
#define IDEM_EVENT_H

#include <stdbool.h>

#include <idem/handler.h>

#include "pg.h"

struct idem_event {
    const char *id;
    const char *type;
    const char *consumer;
    json_t *payload; /* borrowed from the delivery */
    idemp_pg_t *pg;
    bool failed;  /* idem_event_fail or a failed exec recorded a reason */
    bool pg_lost; /* a statement lost the connection */
    char detail[512];
};

/* Prepares ev for one handler call. */
void idemp_event_init(struct idem_event *ev, const char *id, const char *type, const char *consumer,
                      json_t *payload, idemp_pg_t *pg);

#endif
