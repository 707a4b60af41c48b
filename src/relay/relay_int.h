/* relay_int.h - the relay's parts: relay.c (lifecycle, connections, the event loop), relay_ops.c
 * (the gauges, health, systemd, reload), relay_claim.c (a batch's claim and the gap filter) and
 * relay_batch.c (publishing in waves, confirms, marking and committing, and what a broken broker
 * link leaves). Not for other modules. */
#ifndef IDEM_RELAY_INT_H
#define IDEM_RELAY_INT_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <idem/relay.h>

#include "metrics.h"
#include "pg.h"
#include "rmq.h"

/* R_UNSENT: claimed, waiting for the confirm of its subscription's previous row in the batch;
 * R_HELD: not published because an earlier row of its subscription failed (it stays pending and
 * waits behind that row's retry); R_UNKNOWN: published, the link died before its confirm (stays
 * pending); R_POISON: cannot be published because of what it carries (spends an attempt). */
enum rstate { R_UNSENT, R_SENT_WAIT, R_ACKED, R_NACKED, R_RETURNED, R_HELD, R_UNKNOWN, R_POISON };

typedef struct row {
    char outbox_id[37], event_id[37], subscription_id[37];
    char tid[24]; /* where the row is (its ctid), stable while our row lock holds */
    const char *event_type, *payload, *headers; /* borrowed from the claim result */
    int64_t created_s, seq;
    uint64_t tag;
    int prev; /* index of the previous row of the same subscription in the batch, or -1 */
    enum rstate state;
    char why[200]; /* R_POISON: the reason */
} row_t;

/* Where a slot's batch is. Each phase but FREE and PUBLISHING waits for one pipeline on the
 * slot's connection; PUBLISHING waits for the broker's confirms. */
enum slot_phase {
    SLOT_FREE,
    SLOT_LOCKING,    /* BEGIN, settings and step 1 of the claim sent (relay_claim.c) */
    SLOT_READING,    /* step 2 of the claim sent */
    SLOT_PUBLISHING, /* rows claimed, published in waves, confirms awaited */
    SLOT_SETTLING    /* marks and COMMIT sent */
};

/* A claiming transaction on a connection of its own, with its batch. Several slots let batches
 * wait for their confirms while the next is claimed and earlier ones commit; their subscriptions
 * are disjoint (each one's head row is locked by one transaction), so per-subscription order is
 * unaffected. */
typedef struct slot {
    idemp_pg_t *pg;
    enum slot_phase phase;
    row_t *rows; /* batch entries */
    size_t n;
    size_t waiting;            /* rows published and not yet confirmed */
    idemp_rows_t *heads, *res; /* own the rows' strings while in flight (claim steps 1, 2) */
    uint64_t order;            /* claim order, to settle the oldest first after a broken link */
    uint64_t wakes;            /* the relay's wakes when this claim started */
    int64_t t0, t_claim, t_pub, t_settle;
    int64_t t_heard; /* last publish or confirm of this batch: its confirm timeout runs from here */
    /* the pipeline in flight was sent at t_sent; once it has waited a while, who blocks it
     * (relay_ops.c) is asked once, and named if it ends on a lock timeout */
    int64_t t_sent;
    bool probed;
    char holder[200];
} slot_t;

/* A gauge's read (relay_ops.c): sent on its connection, answered in a later turn of the loop. */
typedef struct gauge_read {
    idemp_pg_t *pg; /* r->ctl or r->rows_pg */
    bool inflight;
    int64_t next_ms, t0;
} gauge_read_t;

/* Batches in flight per relay: claimed, published or committing at once. More let the broker
 * and PostgreSQL work at the same time; each holds a connection, its rows and its subscriptions'
 * locks. IDEM_RELAY_INFLIGHT (2-8) overrides the default, an internal tunable; in once mode two
 * are used, and never more than IDEMP_RELAY_INFLIGHT_ROWS rows in all (but at least two). */
#define IDEMP_RELAY_INFLIGHT_DEFAULT 4
#define IDEMP_RELAY_INFLIGHT_MAX 8
#define IDEMP_RELAY_INFLIGHT_ROWS 4096
#define SUSPECTS_MAX 256
#define SUSPECTS_KEEP_MS (10 * 60 * 1000)

struct idem_relay {
    idem_relay_config_t cfg;
    char *pg_conninfo, *amqp_url, *exchange;
    char settings[2][24]; /* lock_timeout, statement_timeout in ms */
    slot_t slots[IDEMP_RELAY_INFLIGHT_MAX];
    int nslots;
    idemp_pg_t *ctl; /* LISTENs and reads the gauge, outside the batches' transactions */
    uint64_t claims;
    char
        cursor[37]; /* the subscription of the last head claimed: the next claim walks on from it */
    idemp_amqp_t *amqp;
    idemp_metrics_t *metrics;
    /* the gauges (relay_ops.c), with metrics: the oldest pending row's age read on ctl, the row
     * counts on a connection of their own (a long count never delays the age) */
    idemp_pg_t *rows_pg;
    gauge_read_t gauges[2];
    /* health and readiness (relay_ops.c) */
    char pg_failed_state[6]; /* SQLSTATE of the last failed statement */
    bool claimed_once;       /* a claim went through (empty or not): serving */
    bool ready, stopping_told;
    char told[96];
    int64_t pg_wait_until; /* after a failed statement: no claim before this */
    int pg_failures;
    bool schema_checked; /* the database is migrated to what this relay needs */
    bool want_claim;     /* rows are probably due: claim when a slot is free */
    /* relay_wake.c: the relay is busy (rows found or a NOTIFY lately) until busy_until_ms; it
     * polls every fast_poll_ms, doubling while claims find nothing (at most 4 ms while busy, up
     * to the backstop poll after). */
    int64_t busy_until_ms, fast_poll_ms;
    bool idle_said;          /* our row of idem_relay_idle is there */
    int64_t idle_written_ms; /* when we last wrote it (it counts for 30 s: sql/023) */
    bool idle_broken;        /* the idle row cannot be written (an older schema): stay busy-less */
    uint64_t wakes;          /* NOTIFYs, polls and commits so far: each makes rows probably due */
    int64_t next_poll_ms;    /* the backstop poll: claim at this time even without a NOTIFY */
    int fail_rc;             /* once mode: the first failure, returned by idem_relay_run */
    idem_error_t fail_err;
    /* rows that were unconfirmed when the broker closed the channel for a message (and rows found
     * to be such a message): each goes out alone until it is confirmed (relay_batch.c) */
    char suspects[SUSPECTS_MAX][37];
    size_t nsuspects;
    int64_t suspects_until;
    bool suspect_out;     /* a suspect is published and waits for its confirm */
    bool suspect_waiting; /* a suspect waits to go out alone: no new claims meanwhile */
    bool reopen_amqp;     /* a batch was nacked: a fresh channel before the next claim */
    idem_relay_stats_t stats;
    volatile sig_atomic_t no_stop;
};

/* ---- relay_wake.c ---- */

/* Rows are probably due: claim when a slot is free. */
void idemp_relay_wake(idem_relay_t *r);

/* The control connection is (re)connected: idle rows of relays that are gone are deleted (their
 * emitters would go on notifying), ours is not there yet. */
void idemp_relay_wake_connected(idem_relay_t *r);

/* A NOTIFY came, or step 1 of a claim found rows: the relay is busy for a while. */
void idemp_relay_busy(idem_relay_t *r);

/* Step 1 of a claim found no row: the next poll waits a little longer. */
void idemp_relay_found_none(idem_relay_t *r);

/* How long until the next backstop poll from now: short while busy, the poll interval when
 * idle. */
int64_t idemp_relay_poll_every(const idem_relay_t *r);

/* Says idle or busy in idem_relay_idle when that changed (a statement on the control
 * connection), and says idle again every IDLE_REFRESH_MS while idle: emitters count a row for
 * 30 s after it was written. Going idle asks for one more claim: a row committed by an emitter
 * that did not see the idle row yet is found by it, or by the backstop poll. */
void idemp_relay_wake_step(idem_relay_t *r, bool quiet);

/* The relay stops: its idle row goes with it (a row left behind names a session that is gone,
 * which emitters look up on every emit until a relay connects again). */
void idemp_relay_wake_stop(idem_relay_t *r);

/* ---- relay_claim.c ---- */

/* One claimed row as the gap filter sees it: its subscription, seq, and the seq of the pending
 * row before it in its subscription (NULL when none). */
typedef struct gap_row {
    const char *subscription_id, *seq, *prev_pending_seq;
} gap_row_t;

/* The gap filter (pure): rows come in seq order; keep[i] is set when row i may go out, that is
 * when its subscription's rows so far form a run of consecutive pending rows from the first one
 * (each row's previous pending row is the previous kept row of its subscription, or none). After
 * a gap, the rest of that subscription waits for a later claim. Returns how many are kept, at
 * most max. */
size_t idemp_relay_gap_filter(const gap_row_t *rows, size_t n, size_t max, bool *keep);

/* Starts a claim on the free slot sl: BEGIN with the transaction's settings and step 1 are sent
 * (SLOT_LOCKING). */
int idemp_relay_claim_start(idem_relay_t *r, slot_t *sl, idem_error_t *err);
/* The claim's pipeline on sl was answered (rows: its kept results, taken over): step 1 leads to
 * step 2 (SLOT_READING); step 2 to the batch (SLOT_PUBLISHING, its first wave out), or, with
 * nothing to claim, to an empty commit (SLOT_SETTLING). *claimed = rows of the batch. */
int idemp_relay_claim_step(idem_relay_t *r, slot_t *sl, idemp_rows_t **rows, size_t *claimed,
                           idem_error_t *err);

/* ---- relay_batch.c ---- */

/* Publishes every row of sl that may go now: a subscription's next row once the broker has
 * confirmed its previous one. */
int idemp_relay_publish(idem_relay_t *r, slot_t *sl, idem_error_t *err);
/* Reads the broker's confirms that have arrived, without blocking. */
int idemp_relay_take_confirms(idem_relay_t *r, idem_error_t *err);
/* True when no row of sl waits for a confirm or a wave. */
bool idemp_relay_settled(const slot_t *sl);
/* Sends the marks of sl's batch by its confirms and its COMMIT (SLOT_SETTLING); with seam, a batch
 * with a confirmed row first passes the fault seam relay.after_publish. */
int idemp_relay_settle(idem_relay_t *r, slot_t *sl, bool seam, idem_error_t *err);
/* The settle pipeline on sl was answered: stats, metrics, the batch's log line; sl is free. */
void idemp_relay_settled_ok(idem_relay_t *r, slot_t *sl, idemp_rows_t **rows);
/* Frees sl (its transaction is over or rolled back). */
void idemp_relay_slot_done(slot_t *sl);
/* Rolls back sl's transaction (waiting for a pipeline in flight) and frees it: nothing spent. */
void idemp_relay_abort_slot(idem_relay_t *r, slot_t *sl);
/* The link to the broker failed (rc, err): every batch is finished at once. Rows confirmed so far
 * are marked sent and committed, unconfirmed ones stay pending; when the broker closed the channel
 * because of a message and one row alone was unconfirmed, that row spends an attempt; when
 * several were, they become suspects. Claims in flight are rolled back. */
void idemp_relay_salvage(idem_relay_t *r, int rc, const idem_error_t *err);
size_t idemp_relay_unconfirmed(const idem_relay_t *r);

/* ---- relay_ops.c ---- */
/* The gauges: the oldest pending row's age every second, the counts of pending and failed rows
 * as often as they are cheap; each read is sent and its answer taken in a later turn. */
int idemp_relay_gauges_new(idem_relay_t *r);
void idemp_relay_gauge_step(idem_relay_t *r);

/* A pipeline of sl was sent: its wait starts now. */
void idemp_relay_sent(slot_t *sl);
/* Asks, for each batch whose statement has waited a while, which sessions block it
 * (pg_blocking_pids, on the control connection or a free slot's), and keeps their pids, roles and
 * application names for the line a lock timeout logs; with no lock_timeout, logs them at once. */
void idemp_relay_holder_step(idem_relay_t *r);
/* For the loop's poll: the socket of the counts' read in flight goes into pfd (ctl's is polled
 * anyway), and *wait is lowered to when the next read is due. */
void idemp_relay_gauge_wait(const idem_relay_t *r, struct pollfd *pfd, nfds_t *n, int64_t now,
                            int64_t *wait);
/* The health (metrics, /healthz); with sd_notify, READY=1 once connected and a claim went
 * through, then STATUS= when the health changes. */
void idemp_relay_report(idem_relay_t *r);
/* STOPPING=1 once (with sd_notify). */
void idemp_relay_stopping_told(idem_relay_t *r);
/* *cfg.reload was set: re-reads the password file through cfg.reload_password, logs "reloaded". */
void idemp_relay_reload(idem_relay_t *r);

/* Once, on the first connection (relay.c's ensure_pg): is the database migrated to what this
 * relay needs (idemp_pg_schema_check)? IDEM_ERR_NOT_FOUND ends the run; a failure to ask drops
 * that connection and is asked again (once mode: returned). */
int idemp_relay_check_schema(idem_relay_t *r, idem_error_t *err);

#endif
