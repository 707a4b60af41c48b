/* relay_int.h - the relay's parts: relay.c (lifecycle, connections, the loop, the backlog gauge)
 * and relay_batch.c (a batch: claim, gap filter, publish in waves, marking). Not for other
 * modules. */
#ifndef IDEM_RELAY_INT_H
#define IDEM_RELAY_INT_H

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
    const char *event_type, *payload, *headers; /* borrowed from the claim result */
    int64_t created_s, seq;
    uint64_t tag;
    int prev; /* index of the previous row of the same subscription in the batch, or -1 */
    enum rstate state;
    char why[200]; /* R_POISON: the reason */
} row_t;

/* A claiming transaction with its published batch. Two slots let one batch's confirms be in
 * flight while the other is claimed or committed; their subscriptions are disjoint (advisory
 * locks), so per-subscription order is unaffected. */
typedef struct slot {
    idemp_pg_t *pg;
    row_t *rows;
    size_t n;
    idemp_rows_t *res; /* owns the rows' strings while in flight */
    uint64_t last_tag;
    bool inflight;  /* transaction open, batch claimed; confirms may be pending */
    bool confirmed; /* every published row of the batch is acked, nacked or returned */
    uint64_t order; /* claim order, to settle the oldest first */
    int64_t t0, t_claim, t_pub, t_conf;
    int64_t wait_ms; /* time spent blocked on the broker's confirms */
} slot_t;

#define NSLOTS 2
#define SUSPECTS_MAX 256
#define SUSPECTS_KEEP_MS (10 * 60 * 1000)

struct idem_relay {
    idem_relay_config_t cfg;
    char *pg_conninfo, *amqp_url, *exchange;
    char settings[2][24]; /* lock_timeout, statement_timeout in ms */
    slot_t slots[NSLOTS];
    idemp_pg_t *ctl; /* LISTENs and reads the gauge, outside the batches' transactions */
    uint64_t claims;
    idemp_amqp_t *amqp;
    idemp_metrics_t *metrics;
    int64_t gauge_next_ms;
    int64_t pg_wait_until; /* after a failed statement: no claim before this */
    int pg_failures;
    /* rows that were unconfirmed when the broker closed the channel for a message (and rows found
     * to be such a message): each goes out alone until it is confirmed (relay_batch.c) */
    char suspects[SUSPECTS_MAX][37];
    size_t nsuspects;
    int64_t suspects_until;
    bool suspect_out; /* a suspect is published and waits for its confirm */
    bool reopen_amqp; /* a batch was nacked: a fresh channel before the next claim */
    idem_relay_stats_t stats;
    volatile sig_atomic_t no_stop;
};

/* ---- relay_batch.c ---- */

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

/* Claims a batch into sl (BEGIN ... claim, the transaction stays open) and publishes its first
 * wave. *claimed = rows claimed. */
int idemp_relay_claim(idem_relay_t *r, slot_t *sl, size_t *claimed, idem_error_t *err);
/* Publishes the first wave of a batch just claimed (relay_batch.c). */
int idemp_relay_publish_first(idem_relay_t *r, slot_t *sl, idem_error_t *err);
/* Waits for sl's confirms, publishing the next wave each time, until the batch is settled. */
int idemp_relay_confirm(idem_relay_t *r, slot_t *sl, idem_error_t *err);
/* Marks sl's rows by their confirms and commits. */
int idemp_relay_commit(idem_relay_t *r, slot_t *sl, idem_error_t *err);
/* The link to the broker failed (rc, err): rows confirmed so far are marked sent and committed,
 * unconfirmed ones stay pending; when the broker closed the channel because of a message and one
 * row alone was unconfirmed, that row spends an attempt; when several were, they become
 * suspects. Rolls back whatever cannot be committed. */
void idemp_relay_salvage(idem_relay_t *r, int rc, const idem_error_t *err);
/* Rolls back sl's transaction, or every open batch: nothing is spent. */
void idemp_relay_abort_slot(idem_relay_t *r, slot_t *sl);
void idemp_relay_abort_all(idem_relay_t *r);
bool idemp_relay_isolating(idem_relay_t *r);

/* relay.c */
void idemp_relay_update_gauge(idem_relay_t *r, bool force);

#endif
