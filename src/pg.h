/* pg.h - the PostgreSQL adapter: a connection object that keeps its parameters, reconnects on
 * request, runs parameterized statements (prepared once per connection) and sorts failures into
 * "server refused" (sqlstate) and "connection lost". */
#ifndef IDEM_PG_H
#define IDEM_PG_H

#include <stdbool.h>

#include <libpq-fe.h>

#include <idem/error.h>

typedef struct idemp_pg idemp_pg_t;

/* New, unconnected; conninfo is copied. NULL on allocation failure. */
idemp_pg_t *idemp_pg_new(const char *conninfo);
void idemp_pg_free(idemp_pg_t *pg);

/* One connection attempt (closing any previous connection). IDEM_ERR_PG_CONNECT with the text
 * "cannot connect to PostgreSQL at HOST:PORT: REASON". */
int idemp_pg_connect(idemp_pg_t *pg, idem_error_t *err);
/* Session settings sent after every (re)connect, e.g. "SET plan_cache_mode = ...": a constant
 * string, borrowed. */
void idemp_pg_set_session_sql(idemp_pg_t *pg, const char *sql);
void idemp_pg_disconnect(idemp_pg_t *pg);
bool idemp_pg_connected(const idemp_pg_t *pg);
PGconn *idemp_pg_conn(idemp_pg_t *pg); /* borrowed; NULL when not connected */
const char *idemp_pg_where_str(const idemp_pg_t *pg);

/* Runs sql with text params as a prepared statement (cached by SQL text). out (optional)
 * receives a new PGresult on success. Returns IDEM_OK, IDEM_ERR_PG_QUERY (err->sqlstate set) or
 * IDEM_ERR_PG_LOST (the connection is then marked for reconnect). */
int idemp_pg_exec(idemp_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  PGresult **out, idem_error_t *err);

/* Pipeline mode (libpq 14+): between begin and end, idemp_pg_exec and idemp_pg_command queue
 * their statement and return IDEM_OK at once unless the caller asks for a result (out), in which
 * case everything queued so far is read first. Errors of queued statements are reported by
 * idemp_pg_pipeline_end (the first one; later statements are skipped by the server). */
int idemp_pg_pipeline_begin(idemp_pg_t *pg, idem_error_t *err);
int idemp_pg_pipeline_end(idemp_pg_t *pg, idem_error_t *err);
/* Reads everything queued and leaves pipeline mode, keeping any error for pipeline_end; for
 * callers that need the plain connection in the middle of a pipeline. */
void idemp_pg_pipeline_pause(idemp_pg_t *pg);

/* A parameterless utility statement (BEGIN, COMMIT, ROLLBACK, LISTEN x). */
int idemp_pg_command(idemp_pg_t *pg, const char *sql, idem_error_t *err);

/* The same over a bare PGconn (no preparation); used by the API taking a caller's PGconn. */
int idemp_pgconn_exec(PGconn *conn, const char *sql, int nparams, const char *const *params,
                      PGresult **out, idem_error_t *err);

/* True for errors worth retrying: SQLSTATE 40001, 40P01, 55P03, 57014, or a lost connection. */
bool idemp_pg_is_transient(const idem_error_t *err);

/* Connects a bare PGconn for one-shot commands; NULL with err set (IDEM_ERR_PG_CONNECT). */
PGconn *idemp_pg_connect_once(const char *conninfo, idem_error_t *err);

#endif
