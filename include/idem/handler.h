/* idem/handler.h - what a handler sees and how it answers.
 *
 * A handler is called once per new event (its id already claimed for the consumer) with the
 * consumer's PostgreSQL transaction open. Everything it writes through that connection commits
 * together with the claim, or not at all. The transaction is the runtime's: a handler that runs
 * COMMIT, ROLLBACK (other than ROLLBACK TO SAVEPOINT) or END itself, or changes
 * synchronous_commit, search_path or session_replication_role, is dead-lettered as
 * handler_rejected whatever it returns, and nothing of its transaction commits (a COMMIT of its
 * own is refused by the server; idem_event_exec refuses COMMIT, ROLLBACK, BEGIN and the like
 * with SQLSTATE 2D000). Statements it runs on the bare connection after its own ROLLBACK run
 * outside any transaction: the runtime cannot undo them.
 * Threads: a handler runs on the consumer's thread; the event and everything it returns are
 * valid only during the call. */
#ifndef IDEM_HANDLER_H
#define IDEM_HANDLER_H

#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>
#include <libpq-fe.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_event idem_event_t; /* borrowed by the handler for the call only */

typedef enum idem_outcome {
    IDEM_DONE = 0, /* effects applied; commit and ack */
    IDEM_RETRY,    /* transient failure: no effect, try again later (bounded by max-retries) */
    IDEM_REJECT,   /* permanent failure: dead-letter as handler_rejected */
    IDEM_INVALID,  /* the payload is unusable: dead-letter as invalid_payload, never retried */
} idem_outcome;

typedef idem_outcome (*idem_handler_fn)(idem_event_t *ev, void *userdata);

/* Accessors; strings and the payload are borrowed and live until the handler returns. */
const char *idem_event_id(const idem_event_t *ev); /* lowercase canonical UUID */
const char *idem_event_type(const idem_event_t *ev);
const char *idem_event_consumer(const idem_event_t *ev); /* the consumer name */
/* The subscription (lowercase UUID) from the subscription_id header, else the payload's
 * subscription_id; NULL when neither is a UUID. */
const char *idem_event_subscription(const idem_event_t *ev);
/* The relay's x-idem-seq header (strictly increasing per subscription in emit order): true and
 * *seq set when the message carries one. */
bool idem_event_seq(const idem_event_t *ev, int64_t *seq);
/* A string header of the message (e.g. "traceparent"), NUL-terminated, or NULL when absent, not
 * a string, over 1023 bytes or containing NUL. Valid until the next call or the return. */
const char *idem_event_header(idem_event_t *ev, const char *name);
json_t *idem_event_payload(const idem_event_t *ev); /* a JSON object, borrowed */
PGconn *idem_event_conn(idem_event_t *ev); /* the open transaction, borrowed (no pipelining) */

/* Records why the handler fails (one line; the first call wins) and returns outcome, so a
 * handler can write `return idem_event_fail(ev, IDEM_INVALID, "amount_cents: missing");`. */
idem_outcome idem_event_fail(idem_event_t *ev, idem_outcome outcome, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Runs one parameterized statement in the event's transaction (prepared once per connection,
 * keyed by the SQL text, which must therefore be a constant). On success returns IDEM_DONE and,
 * if out is non-NULL, a new PGresult the caller must PQclear. On failure it records the server's
 * message and SQLSTATE and returns IDEM_REJECT for class 22, 23, 2D and P0, IDEM_RETRY
 * otherwise; *out is then NULL. Whatever the handler then returns, the consumer applies its
 * failure policy to the recorded SQLSTATE: 40001, 40P01, 55P03, 57014 retry; class 22, 23, 2D
 * (transaction termination) and P0 (PL/pgSQL: RAISE, INTO STRICT, ASSERT) reject; anything else (a
 * read-only server, a missing table, a full disk, a lost connection) pauses the consumer without
 * spending a try. A later statement that succeeds (after a ROLLBACK TO SAVEPOINT the handler ran
 * this way) clears the recorded failure. Inside a batch, a statement without out may be queued
 * (pipelined) and IDEM_DONE returned at once; if it fails, the whole batch rolls back and every
 * event is run again in a transaction of its own, where this function reports the failure as above.
 * Handlers therefore need no special care, but must not keep side effects outside the database. A
 * handler that ignores a failed statement and returns IDEM_DONE does not lose the event: the
 * aborted transaction cannot commit, and the event is retried. */
idem_outcome idem_event_exec(idem_event_t *ev, const char *sql, int nparams,
                             const char *const *params, PGresult **out);

#ifdef __cplusplus
}
#endif
#endif
