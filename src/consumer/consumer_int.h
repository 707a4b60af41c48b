/* consumer_int.h - the consumer's parts: consumer.c (lifecycle, connections, topology, the loop),
 * consumer_tx.c (a batch's transaction and how it settles), consumer_window.c (the deliveries in
 * hand: which may go next, which can be acked). Not for other modules. */
#ifndef IDEM_CONSUMER_INT_H
#define IDEM_CONSUMER_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <idem/consumer.h>
#include <idem/log.h>

#include "backoff.h"
#include "digest.h"
#include "envelope.h"
#include "metrics.h"
#include "pg.h"
#include "registry.h"
#include "rmq.h"

/* PostgreSQL connections of a consumer: batches whose COMMIT may be on its way at once, plus
 * one. */
#define IDEMP_CONSUMER_CONNS 2

/* A delivery's life: read and validated (READY, or DEAD when it must be dead-lettered), tried in
 * a transaction, then DONE (committed, duplicate or dead-lettered: ack it) or WAIT (a retry or a
 * pause: due again at due_ms). COMMITTING: its batch's COMMIT is on its way (consumer_tx.c); it
 * holds its subscription like any unfinished delivery and is not acked.
 */
enum dstate { D_READY, D_WAIT, D_DEAD, D_DONE, D_COMMITTING };

/* Runs right before the runtime's COMMIT (sql/008_claim_guard.sql): fails with SQLSTATE IDEM2 when
 * a handler ended the claim's transaction or changed a setting the runtime relies on, and
 * otherwise arms the COMMIT (any other COMMIT of a claim's transaction is refused). Qualified, so
 * that a handler's search_path cannot hide it. */
#define SQL_CLAIM_COMMIT "SELECT idem.idem_claim_commit(pg_catalog.current_setting('search_path'))"

typedef struct delivery {
    idemp_msg_t *msg; /* owned */
    uint64_t tag;
    idemp_envelope_t ev; /* ev.payload owned */
    const idemp_handler_entry_t *handler;
    enum dstate state;
    int tries; /* failed tries that count against --max-retries */
    int64_t due_ms;
    idemp_dl_code dl_code;
    char last_state[6]; /* SQLSTATE of the last failed try, "" when none */
    char detail[512];
    size_t bytes;                  /* body bytes held */
    int qidx;                      /* the consumed queue it came from (index into queues) */
    char digest[IDEMP_DIGEST_HEX]; /* of its content, for the ledger ("" when not computed) */
    int part;                      /* that queue's partition number; -1 without partitions */
} delivery_t;

/* A handler that calls a SQL function (idem_consumer_register_sql). */
typedef struct sql_handler {
    char *call;      /* SELECT "schema"."fn"($1::uuid, ...) */
    char *signature; /* "schema"."fn"(uuid,text,uuid,jsonb,jsonb), for the existence check */
} sql_handler_t;

struct idem_consumer {
    char *consumer, *queue, *pg_conninfo, *amqp_url, *exchange;
    char *dlq, *dlx, *part_exchange, *unkeyed_exchange;
    char **queues;   /* the queues this process consumes: QUEUE, or its partitions */
    int *queue_part; /* partition number of each (-1 for QUEUE) */
    int nqueues;
    char **binds;                 /* NULL-terminated, owned */
    char **trusted_publishers;    /* NULL-terminated, owned; NULL = any publisher */
    sql_handler_t **sql_handlers; /* owned; registry entries point at them */
    size_t nsql_handlers;
    bool sql_checked;  /* the SQL handlers' functions were found */
    bool claim_check;  /* idem_claim_check exists: batches go in one round trip */
    char *required[8]; /* migrations the handlers need (NULL-terminated, owned) */
    idem_consumer_config_t cfg;
    idemp_registry_t *reg;
    /* PostgreSQL: the next transaction runs on pg, one of pgs with no COMMIT on its way (NULL
     * between sending a COMMIT and the next turn when every one has one), while
     * the COMMITs of earlier batches may be on their way on the others (commits; see
     * consumer_tx.c). The others are connected when first needed: under a light load the
     * consumer uses one. */
    idemp_pg_t *pg;
    idemp_pg_t *pgs[IDEMP_CONSUMER_CONNS];
    struct idemp_commit *commits[IDEMP_CONSUMER_CONNS]; /* NULL: none on its way on pgs[i] */
    uint64_t commit_order;
    idemp_amqp_t *in;  /* consuming connection */
    idemp_amqp_t *out; /* dead-letter publishing connection (confirms) */
    idemp_metrics_t *metrics;
    char settings[2][24]; /* lock_timeout, statement_timeout for set_config, in ms */
    char window_ms[24];   /* the dedup window, in ms (the claim's stale rule) */

    delivery_t **win; /* deliveries in hand, in delivery-tag order */
    size_t nwin, capwin;
    size_t win_bytes;

    int64_t pause_until;
    idemp_backoff_t pause_backoff;
    char pause_cause[8]; /* SQLSTATE (or "conn") of the current pause, "" when not paused */
    int64_t pause_since;
    /* operations (consumer.c): readiness told to systemd, the STATUS= last told, when the idle
     * connections were last checked for a server that went away */
    bool ready;
    char told[96];
    int64_t watch_next_ms;
    volatile sig_atomic_t no_stop;
};

/* ---- consumer_topology.c, consumer_sql.c ---- */

/* printf(fmt, a, i) into a new string (free()), or NULL: the names of the queues and exchanges. */
char *idemp_consumer_name(const char *fmt, const char *a, int i);
/* Declares (or checks) the topology and starts consuming; IDEM_ERR_REFUSED / IDEM_ERR_NOT_FOUND
 * for configurations that cannot work. */
int idemp_consumer_topology(idem_consumer_t *c, idem_error_t *err);
/* Every SQL handler's function exists: IDEM_OK, or IDEM_ERR_NOT_FOUND naming it. */
int idemp_consumer_check_sql(idem_consumer_t *c, idem_error_t *err);

static inline bool idemp_consumer_stopping(const idem_consumer_t *c)
{
    return c->cfg.stop != NULL && *c->cfg.stop;
}

/* ---- consumer_ops.c: what operators see ---- */

/* Reads the idle PostgreSQL connections (once a second) so that a server that went away is
 * noticed while there is nothing to do. */
void idemp_consumer_watch_pg(idem_consumer_t *c);
/* The health (metrics, /healthz) from the connections and the pause; with sd_notify, READY=1
 * once consuming, then STATUS= when the health changes. */
void idemp_consumer_report(idem_consumer_t *c);
/* STOPPING=1 (with sd_notify). */
void idemp_consumer_stopping_told(idem_consumer_t *c);
/* *cfg.reload was set: re-reads the password file through cfg.reload_password, logs "reloaded". */
void idemp_consumer_reload(idem_consumer_t *c);

/* ---- consumer_inbox.c: deliveries in, dead letters and acks out ---- */

/* Reads new deliveries into the window: waits up to first_wait_ms for the first, then, with
 * linger, lingers for batch-mates (without, takes only what has arrived). Returns false when the
 * channel was lost (the window is then empty). */
bool idemp_consumer_read(idem_consumer_t *c, int64_t first_wait_ms, bool linger);
/* Publishes the dead-letter copy of every DEAD delivery (each becomes DONE once confirmed). */
void idemp_consumer_dead_letter_all(idem_consumer_t *c);
/* Acks what is DONE and takes it out of the window. */
void idemp_consumer_ack_done(idem_consumer_t *c);
/* Forgets every delivery in hand; only together with their channel (the broker requeues them). */
void idemp_consumer_drop_window(idem_consumer_t *c);
/* Disconnects both RabbitMQ connections and forgets the window: the deliveries come again. */
void idemp_consumer_channel_lost(idem_consumer_t *c, const char *why);

/* ---- consumer_window.c: pure decisions over the deliveries in hand ---- */

/* Picks into out (capacity max) the deliveries that may be tried now, in tag order: READY ones
 * and WAIT ones that are due, each only if no earlier unfinished delivery of its key (see
 * idemp_window_key) stays behind (a delivery waiting for a retry holds the later ones of its
 * subscription; a dead-lettered one holds nothing). Returns how many were picked. */
size_t idemp_window_pick(delivery_t *const *win, size_t n, int64_t now, delivery_t **out,
                         size_t max);

/* A delivery's place in the order that matters: its subscription within the queue it came from.
 * 0 when it has no subscription. Never 0 otherwise. */
uint64_t idemp_window_key(const delivery_t *d);

/* The earliest time a WAIT delivery becomes due (INT64_MAX when none). */
int64_t idemp_window_next_due(delivery_t *const *win, size_t n);

/* Which DONE deliveries to ack: one basic.ack(multiple) up to *multi_tag (0 = none) covers every
 * DONE delivery older than the oldest unfinished one; the DONE ones after it go one by one, their
 * indexes written to single (capacity n), their count returned. */
size_t idemp_window_ack_plan(delivery_t *const *win, size_t n, uint64_t *multi_tag, size_t *single);

/* ---- consumer_claim.c ---- */

/* SQLSTATE of a one-round-trip batch's claim when an id of the batch is not new. */
#define IDEMP_SQLSTATE_NOT_ALL_NEW "IDEM1"

/* On pg, in a pipeline just begun: BEGIN, the transaction-local settings and the claim of the
 * event ids of ds[0..n), in the batch's order, each with its digest. Marks claimed[i], stale[i]
 * (older than the dedup window by the database's clock) and conflict[i] (its id is in the ledger
 * with another digest: not a duplicate). single: the pipeline is left here, so that the
 * handler's statements fail one by one. all_new: the claim is only queued, every delivery
 * marked claimed; it fails the transaction with IDEMP_SQLSTATE_NOT_ALL_NEW unless each is. */
int idemp_consumer_claim(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                         bool all_new, bool *claimed, bool *stale, bool *conflict,
                         idem_error_t *err);

/* ---- consumer_tx.c ---- */

typedef struct tx_counts {
    uint64_t applied, duplicates;
} tx_counts_t;

/* Tries the deliveries picked (sorted here by subscription, then tag) in one pipelined
 * transaction, falling back to one transaction per delivery when any of them fails; every
 * delivery ends DONE, DEAD (with its code), WAIT (a retry, or a pause of the whole consumer: see
 * idemp_consumer_pause), or READY again (not tried: a pause stopped the batch). */
void idemp_consumer_apply(idem_consumer_t *c, delivery_t **ds, size_t n, tx_counts_t *counts);
/* A batch of more than one delivery leaves idemp_consumer_apply with its COMMIT on its way (its
 * deliveries COMMITTING) while the next batches run on other connections. This settles every
 * batch whose COMMIT's outcome has arrived, as idemp_consumer_apply would have; with wait, first
 * waits for the oldest one in flight. Returns how many were settled. */
size_t idemp_consumer_collect(idem_consumer_t *c, bool wait, tx_counts_t *counts);
/* Waits up to ms for the answer to a COMMIT on its way or for a delivery, whichever comes first
 * (either may have come: see idemp_consumer_collect and idemp_consumer_read). */
void idemp_consumer_wait(idem_consumer_t *c, int64_t ms);
/* Is a COMMIT on its way? */
bool idemp_consumer_busy(const idem_consumer_t *c);
/* Points c->pg at a connection with no COMMIT on its way, waiting for (and settling) the oldest
 * when every one has; returns how many were settled. */
size_t idemp_consumer_take_conn(idem_consumer_t *c, tx_counts_t *counts);
/* Waits for every COMMIT on its way and forgets their outcome (their deliveries are about to be
 * forgotten with their channel: the claim absorbs whatever committed when they come again). */
void idemp_consumer_forget_inflight(idem_consumer_t *c);

/* Pauses the consumer: nothing is tried before the backoff passes; the cause (a SQLSTATE or
 * "conn") is logged at error level when it starts or changes and counted. */
void idemp_consumer_pause(idem_consumer_t *c, const char *cause, const char *detail);

/* ---- consumer_log.c ---- */
/* A log line with the consumer and queue, and d's event_id and event_type (d may be NULL). */
void idemp_consumer_log(idem_log_level lvl, const idem_consumer_t *c, const delivery_t *d,
                        const char *fmt, ...) __attribute__((format(printf, 4, 5)));

#endif
