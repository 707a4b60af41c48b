/* pg.h - the PostgreSQL adapter, the only module that speaks libpq.
 *
 * A connection object keeps its conninfo and its state: it connects on demand with backoff,
 * states a reason when it drops the connection, runs parameterized statements (prepared once
 * per connection), pipelines a transaction when asked, LISTENs, and sorts failures into "the
 * server refused" (a SQLSTATE) and "connection lost" (outcome unknown). Results are read through
 * idemp_rows_t, so the core never touches a PGresult. */
#ifndef IDEM_PG_H
#define IDEM_PG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <idem/error.h>

typedef struct pg_conn PGconn; /* libpq's, for the public handler API only */
typedef struct idemp_pg idemp_pg_t;

/* Query results: an alias of libpq's PGresult, read only through these functions. */
typedef struct idemp_rows idemp_rows_t;
int idemp_rows_count(const idemp_rows_t *r);
const char *idemp_rows_get(const idemp_rows_t *r, int row, int col); /* "" for NULL */
bool idemp_rows_isnull(const idemp_rows_t *r, int row, int col);
int64_t idemp_rows_affected(const idemp_rows_t *r); /* rows touched by an INSERT/UPDATE/DELETE */
void idemp_rows_free(idemp_rows_t *r);              /* NULL is a no-op */

/* New, unconnected; conninfo is copied; component names the log lines ("consumer"). NULL on
 * allocation failure. */
idemp_pg_t *idemp_pg_new(const char *conninfo, const char *component);
void idemp_pg_free(idemp_pg_t *pg);

/* One connection attempt (closing any previous connection). IDEM_ERR_PG_CONNECT with the text
 * "cannot connect to PostgreSQL at HOST:PORT: REASON". TCP keepalives are on by default. */
int idemp_pg_connect(idemp_pg_t *pg, idem_error_t *err);

/* Connects when down and due, with backoff (base_ms doubling to max_ms) between failed attempts,
 * each failure logged once with its reason and the wait. Returns IDEM_OK when connected; sets
 * *reconnected when this call made a connection after an earlier one was lost. */
void idemp_pg_set_backoff(idemp_pg_t *pg, int64_t base_ms, int64_t max_ms);
int idemp_pg_ensure(idemp_pg_t *pg, bool *reconnected, idem_error_t *err);
/* Time until the next connection attempt is due (0 when connected or due). */
int64_t idemp_pg_retry_in_ms(const idemp_pg_t *pg);

/* Drops the connection, logging reason once at warn level (nothing when already down), and
 * makes the next attempt due at once. */
void idemp_pg_disconnect(idemp_pg_t *pg, const char *reason);
bool idemp_pg_connected(const idemp_pg_t *pg);
PGconn *idemp_pg_conn(idemp_pg_t *pg); /* borrowed; NULL when not connected */
const char *idemp_pg_where_str(const idemp_pg_t *pg);
int idemp_pg_socket(const idemp_pg_t *pg);      /* -1 when not connected */
int idemp_pg_backend_pid(const idemp_pg_t *pg); /* the server process's pid; 0 when not connected */

/* Runs sql with text params (NULL = SQL NULL) as a prepared statement (cached by SQL text). out
 * (optional) receives the rows on success. Returns IDEM_OK, IDEM_ERR_PG_QUERY (err->sqlstate
 * set) or IDEM_ERR_PG_LOST (the connection is then dropped). */
int idemp_pg_exec(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  idemp_rows_t **out, idem_error_t *err);

/* A parameterless utility statement (BEGIN, ROLLBACK, LISTEN x). */
int idemp_pg_command(idemp_pg_t *pg, const char *sql, idem_error_t *err);

/* COMMIT, checked: a transaction that an earlier statement aborted is rolled back and reported as
 * IDEM_ERR_PG_ROLLBACK (PostgreSQL answers such a COMMIT with the tag ROLLBACK, not an error).
 * before (NULL for none): a statement without parameters run right before the COMMIT, in the
 * same transaction, once every earlier statement is known to have succeeded; its failure is
 * reported and nothing is committed. In pipeline mode both are queued and the pipeline ended
 * here. IDEM_ERR_PG_LOST: the outcome is unknown. */
int idemp_pg_commit(idemp_pg_t *pg, const char *before, idem_error_t *err);
/* ROLLBACK if a transaction is open (also ends a pipeline first, waiting for a sent one to be
 * answered); errors are only logged. */
void idemp_pg_rollback(idemp_pg_t *pg);
bool idemp_pg_in_transaction(const idemp_pg_t *pg);
/* Outside pipeline mode, connected, and no transaction open: whoever had the connection ended the
 * transaction (false while pipelining: the status is not known there). */
bool idemp_pg_tx_ended(const idemp_pg_t *pg);

/* Pipeline mode (libpq 14+): between begin and end, idemp_pg_exec and idemp_pg_command queue
 * their statement and return IDEM_OK at once unless the caller asks for rows (out), in which
 * case everything queued so far is read first. Errors of queued statements are reported by
 * idemp_pg_pipeline_end (the first one; later statements are skipped by the server). */
int idemp_pg_pipeline_begin(idemp_pg_t *pg, idem_error_t *err);
int idemp_pg_pipeline_end(idemp_pg_t *pg, idem_error_t *err);
/* Queues sql as the pipeline's last statement, syncs, reads everything and leaves pipeline mode:
 * one round trip for the whole pipeline. *out receives sql's rows; an earlier statement's error
 * is returned as by idemp_pg_pipeline_end. */
int idemp_pg_pipeline_finish(idemp_pg_t *pg, const char *sql, int nparams,
                             const char *const *params, idemp_rows_t **out, idem_error_t *err);
/* Reads everything queued and leaves pipeline mode, keeping any error for pipeline_end; for
 * callers that need the plain connection in the middle of a pipeline. */
void idemp_pg_pipeline_pause(idemp_pg_t *pg);

/* Asynchronous pipelines, for a loop that drives several connections at once. After
 * idemp_pg_pipeline_begin, statements are queued (nothing is read): idemp_pg_queue (keep: its
 * result is handed back by idemp_pg_pipeline_poll, in queue order, at most 4),
 * idemp_pg_queue_command (BEGIN) and idemp_pg_queue_commit (a checked COMMIT: an answer of ROLLBACK
 * is the error IDEM_ERR_PG_ROLLBACK). idemp_pg_pipeline_send sends them with a sync and returns at
 * once. The SQL texts must outlive the pipeline (string constants). */
int idemp_pg_queue(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                   bool keep, idem_error_t *err);
int idemp_pg_queue_command(idemp_pg_t *pg, const char *sql, idem_error_t *err);
int idemp_pg_queue_commit(idemp_pg_t *pg, idem_error_t *err);
int idemp_pg_pipeline_send(idemp_pg_t *pg, idem_error_t *err);
/* A sent pipeline is waiting for (the rest of) its results. */
bool idemp_pg_pipeline_sent(const idemp_pg_t *pg);
/* A pipeline is open and not sent yet: more can be queued (false once a handler took the bare
 * connection, see idemp_pg_pipeline_pause). */
bool idemp_pg_pipeline_open(const idemp_pg_t *pg);
/* Reads what has arrived of the sent pipeline without blocking. While more is to come, *done is
 * false and IDEM_OK returned. Once it is answered (or the connection is lost) pipeline mode is
 * left, *done is true, and the outcome returned: IDEM_OK with the kept results in out[0..nout)
 * (new; the caller frees them), or the first error (IDEM_ERR_PG_QUERY with its SQLSTATE,
 * IDEM_ERR_PG_ROLLBACK, or IDEM_ERR_PG_LOST: the connection is then dropped; also when no
 * pipeline is in flight). */
int idemp_pg_pipeline_poll(idemp_pg_t *pg, bool *done, idemp_rows_t **out, int nout,
                           idem_error_t *err);
/* The same, waiting until it is answered. */
int idemp_pg_pipeline_wait(idemp_pg_t *pg, idemp_rows_t **out, int nout, idem_error_t *err);

/* LISTEN on channel (an identifier constant). */
int idemp_pg_listen(idemp_pg_t *pg, const char *channel, idem_error_t *err);
/* Reads what the socket has and drops queued notifications; true if any had arrived. A broken
 * connection is dropped. */
bool idemp_pg_take_notifies(idemp_pg_t *pg);

/* The same statement over a bare PGconn (no preparation); for the API taking a caller's
 * connection and for one-shot commands. */
int idemp_pgconn_exec(PGconn *conn, const char *sql, int nparams, const char *const *params,
                      idemp_rows_t **out, idem_error_t *err);
/* Connects a bare PGconn for one-shot commands; NULL with err set (IDEM_ERR_PG_CONNECT). */
PGconn *idemp_pg_connect_once(const char *conninfo, idem_error_t *err);
void idemp_pgconn_close(PGconn *conn);
bool idemp_pgconn_ok(PGconn *conn); /* connected and usable */
/* Runs a trusted multi-statement script (a migration file) as one simple query. */
int idemp_pgconn_script(PGconn *conn, const char *sql, const char *what, idem_error_t *err);

/* The latest of idem's migrations (sql/) this binary needs; a migration that changes what the
 * code relies on updates it. */
#define IDEMP_SCHEMA_NEEDS "023_relay_idle_ttl.sql"
/* Also needed, applied before or after the latest: consumers' ledger rights and operators'
 * functions (sql/017_narrow_rights.sql). */
#define IDEMP_SCHEMA_NEEDS_ALSO "017_narrow_rights.sql"
/* The database has IDEMP_SCHEMA_NEEDS and each of extra (NULL-terminated, may be NULL: e.g.
 * "billing/001_billing.sql") applied. IDEM_ERR_NOT_FOUND: one line naming `idem migrate` (with
 * --billing for the billing ones); IDEM_ERR_REFUSED: the role may not read the record. */
int idemp_pg_schema_check(PGconn *conn, const char *const *extra, idem_error_t *err);

/* "host:port" of a libpq conninfo or URI for messages, libpq's defaults filled in; a multi-host
 * conninfo gives "h1:p1,h2:p2". */
void idemp_pg_where(const char *conninfo, char *out, size_t outsz);
/* A PostgreSQL URI with "://" past its scheme, an '@' after its host before any '?', or userinfo
 * and another '@' past a '/' or '?': a password holding "://" or '@' and '/' written unencoded,
 * which libpq would read partly as host, port or database. Refused. */
bool idemp_pg_uri_ambiguous(const char *conninfo);

/* Array literals for uuid[]/text[]/bigint[] parameters, built by appending elements. */
typedef struct idemp_pgarray {
    char *buf;
    size_t len, cap, n;
    bool failed; /* an allocation failed: the literal is unusable */
} idemp_pgarray_t;

void idemp_pgarray_init(idemp_pgarray_t *a);
void idemp_pgarray_add(idemp_pgarray_t *a, const char *elem); /* NULL = NULL element */
/* The literal "{...}" (borrowed until the next add or free), or NULL after a failed allocation. */
const char *idemp_pgarray_str(idemp_pgarray_t *a);
void idemp_pgarray_free(idemp_pgarray_t *a);

#endif
