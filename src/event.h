/* event.h - the object a handler receives (opaque in the public API). */
#ifndef IDEM_EVENT_H
#define IDEM_EVENT_H

#include <stdbool.h>
#include <stdint.h>

#include <idem/handler.h>

#include "pg.h"
#include "rmq.h"

struct idem_event {
    const char *id;
    const char *type;
    const char *consumer;
    const char *subscription; /* "" when the delivery names none */
    bool has_seq;
    int64_t seq;
    json_t *payload;        /* borrowed from the delivery */
    const idemp_msg_t *msg; /* the delivery, for its headers */
    idemp_pg_t *pg;
    bool failed;      /* idem_event_fail or a failed exec recorded a reason */
    bool pg_lost;     /* a statement lost the connection */
    char sqlstate[6]; /* of the last statement that failed through idem_event_exec, or "" */
    char detail[512];
    char header_buf[1024]; /* idem_event_header's NUL-terminated copy */
};

/* Prepares ev for one handler call. */
void idemp_event_init(struct idem_event *ev, const char *id, const char *type, const char *consumer,
                      const char *subscription, json_t *payload, const idemp_msg_t *msg,
                      idemp_pg_t *pg);

#endif
