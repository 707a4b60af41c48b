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
    bool took_conn;   /* the handler took the bare connection (idem_event_conn) */
    char sqlstate[6]; /* of the last statement that failed through idem_event_exec, or "" */
    char detail[512];
    char header_buf[1024]; /* idem_event_header's NUL-terminated copy */
};

/* Prepares ev for one handler call. */
void idemp_event_init(struct idem_event *ev, const char *id, const char *type, const char *consumer,
                      const char *subscription, json_t *payload, const idemp_msg_t *msg,
                      idemp_pg_t *pg);

/* Does sql end or begin a transaction (COMMIT, END, ROLLBACK but not ROLLBACK TO, ABORT,
 * BEGIN, START TRANSACTION, PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED), judged by its first
 * words? idem_event_exec refuses such a statement: the claim's transaction is the runtime's. */
bool idemp_sql_ends_transaction(const char *sql);

#endif
