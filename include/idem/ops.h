/* idem/ops.h - operations: schema migrations, retention, backlog health, failed rows, replay.
 *
 * Every function takes a borrowed PGconn that is not inside a transaction; each manages its own
 * short transactions. JSON results are new references the caller must json_decref. */
#ifndef IDEM_OPS_H
#define IDEM_OPS_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>
#include <libpq-fe.h>

#include <idem/error.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Applies the numbered *.sql files of sql_dir (NULL = the directory found next to the binary,
 * then $IDEM_SQL_DIR, then the installed share/idem/sql) that are not yet recorded in
 * idem.idem_schema_migrations, each in its own transaction (nothing of a file that fails stays;
 * the error names it), in order. Every object goes to schema idem, created here; the session's
 * search_path is pg_catalog, idem, pg_temp while they run (nothing planted in another schema
 * runs). A database migrated by an older idem (objects and record in the first schema of the
 * connection's search_path that has them, usually public) is moved into idem first. Writes one
 * line per applied file to out (if non-NULL) and sets *applied. Safe to run concurrently (each
 * migration's transaction locks idem.idem_migrate_lock; waits bounded by lock_timeout, 60s when
 * the session has none). */
int idem_migrate(PGconn *conn, const char *sql_dir, FILE *out, int *applied, idem_error_t *err);

/* flags: the bundled billing handlers' tables too (sql_dir/billing/, schema billing), after
 * idem's own migrations. */
#define IDEM_MIGRATE_BILLING 1
int idem_migrate_with(PGconn *conn, const char *sql_dir, int flags, FILE *out, int *applied,
                      idem_error_t *err);

/* Writes "applied NAME" or "pending NAME" for each migration of the set flags selects, in order,
 * and sets *pending to how many are pending; changes nothing (but the session's search_path). */
int idem_migrate_status(PGconn *conn, const char *sql_dir, int flags, FILE *out, int *pending,
                        idem_error_t *err);

typedef struct idem_retain_config {
    int64_t outbox_keep_ms;      /* sent outbox rows older than this (by sent_at) go; default 7d */
    int64_t dedup_window_ms;     /* ledger rows older than this (by consumed_at) go; default 30d */
    int64_t keys_keep_ms;        /* emitted keys older than this (first emit) go; default 400d */
    int batch;                   /* rows per DELETE statement (own transaction); default 5000 */
    bool force;                  /* allow a dedup window shorter than the outbox window or 1d */
    volatile sig_atomic_t *stop; /* optional: stop between batches */
} idem_retain_config_t;

typedef struct idem_retain_result {
    bool skipped; /* another run holds the retention lock; nothing was deleted */
    /* when skipped: who holds the lock ("pid 4242, role app, application psql"), or "" */
    char holder[192];
    int64_t outbox_deleted, outbox_batches;
    int64_t ledger_deleted, ledger_batches;
    int64_t keys_deleted, keys_batches;
} idem_retain_result_t;

void idem_retain_config_init(idem_retain_config_t *cfg);
/* Runs one retention pass. Another run holding the lock (the row 'retain' of idem.idem_leases,
 * held by the backend that wrote its pid there while that backend lives): res->skipped,
 * returns 0. Stopped through cfg->stop between batches: IDEM_ERR_INTERRUPTED with the counts of
 * what was deleted so far in res. */
/* IDEM_ERR_REFUSED when the windows break the rules without force: the dedup window must be at
 * least the outbox window and 1d, and the emitted keys must be kept at least as long as both
 * (a replay must collapse as long as its event could still be applied again). */
int idem_retain_check(const idem_retain_config_t *cfg, idem_error_t *err);
int idem_retain_run(PGconn *conn, const idem_retain_config_t *cfg, idem_retain_result_t *res,
                    idem_error_t *err);

/* The backlog document of `idem status --json` (see the contract), plus "consumers": the ledger
 * per consumer ({consumer, ledger_rows, last_applied_at, last_applied_seconds, queues: []}); new
 * reference in *out. */
int idem_status_query(PGconn *conn, json_t **out, idem_error_t *err);
/* The same, and with explain_rows >= 0 also "pending_rows": why the pending rows wait, read in the
 * same snapshot: {by_reason: {in_flight, behind_in_flight, retrying, held, due: counts},
 * holders: [{pid, rows, application_name, user, state, transaction_seconds}] (the backends whose
 * open transactions lock pending rows), oldest: [the explain_rows oldest pending rows, each
 * {event_id, event_type, subscription_id, attempts, age_seconds, reason, pid,
 * next_attempt_in_seconds, behind_event_id, behind_attempts}]}. */
int idem_status_query_with(PGconn *conn, int explain_rows, json_t **out, idem_error_t *err);
/* Adds the depths of queues to doc (from idem_status_query): each "CONSUMER=QUEUE" (the text up to
 * the first '=' names the consumer; "=QUEUE" or a name without '=' is a queue of no consumer)
 * goes to CONSUMER's entry of doc["consumers"] (a new one when the ledger has none) as {queue,
 * ready, consumers, dlq, dlq_ready, error}, read with passive declares (ready counts messages
 * not delivered; the broker does not say how many are delivered and unacked over AMQP). Sets
 * doc["rabbitmq_error"] (null when every queue was read). IDEM_ERR_AMQP_CONNECT (or another AMQP
 * error) when RabbitMQ could not be reached or the link broke: the queues say so one by one. */
int idem_status_queues(json_t *doc, const char *amqp_url, const char *amqp_password,
                       const char *const *queues, int n, idem_error_t *err);

/* Failed outbox rows as a JSON array of objects (event_id, outbox_id, event_type,
 * subscription_id, attempts, created_at, last_error), oldest first; new reference in *out. */
int idem_failed_list(PGconn *conn, json_t **out, idem_error_t *err);

/* Returns failed rows to pending (attempts 0, next attempt now, last_error kept). event_id NULL
 * means every failed row. Refuses (IDEM_ERR_REFUSED, nothing changed) when a row is older than
 * dedup_window_ms by created_at, and (IDEM_ERR_NOT_FOUND) when event_id is not a failed row.
 * *replayed receives the number of rows returned to pending. */
int idem_replay(PGconn *conn, const char *event_id, int64_t dedup_window_ms, int *replayed,
                idem_error_t *err);

/* ---- a consumer's dead-letter queue (QUEUE.dlq) ---- */

typedef struct idem_dlq_config {
    const char *amqp_url;      /* one URL or a comma-separated list */
    const char *amqp_password; /* overrides the URL's when set */
    const char *queue;         /* the consumer's queue; its DLQ is QUEUE.dlq */
    int limit;                 /* list: at most this many (default 100) */
    const char *event_id;      /* show: this event; requeue, discard: only it (NULL = all) */
    const char *code;          /* requeue, discard: only this dead-letter code (NULL = any) */
    int heartbeat_s;           /* 0 (default) = off */
} idem_dlq_config_t;

void idem_dlq_config_init(idem_dlq_config_t *cfg);

/* The first cfg->limit messages of QUEUE.dlq, oldest first, as a JSON array of objects
 * {event_id, event_type, code, detail, age_seconds, requeued} (new reference in *out); nothing is
 * taken off the queue. IDEM_ERR_AMQP_CONNECT, IDEM_ERR_NOT_FOUND (no such DLQ), IDEM_ERR_AMQP. */
int idem_dlq_list(const idem_dlq_config_t *cfg, json_t **out, idem_error_t *err);

/* Moves the selected messages of QUEUE.dlq back to QUEUE (or a partitioned group's QUEUE.hash):
 * each publish is confirmed before its DLQ copy is acked; x-idem-error is removed and
 * x-idem-requeued counts the moves. *moved receives how many moved (also on failure). */
int idem_dlq_requeue(const idem_dlq_config_t *cfg, int *moved, idem_error_t *err);

/* The first message of QUEUE.dlq whose event id is cfg->event_id (any UUID form), as the object
 * of idem_dlq_list plus properties, headers (every AMQP kind), routing_key, body_bytes, body and
 * body_escaped (bytes that are not UTF-8 shown as \xNN); new reference in *out. Nothing is taken
 * off the queue. IDEM_ERR_NOT_FOUND when it is not there (or there is no such DLQ). */
int idem_dlq_show(const idem_dlq_config_t *cfg, json_t **out, idem_error_t *err);

/* Removes the selected messages of QUEUE.dlq for good (each acked; what is not selected stays,
 * in its place). *discarded receives how many were removed (also on failure). */
int idem_dlq_discard(const idem_dlq_config_t *cfg, int *discarded, idem_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
