/* consumer_tx.c - one transaction over a batch of deliveries: claim the event ids
 * (consumer_claim.c), run the handlers on the same connection, COMMIT, a batch's COMMIT left on
 * its way while the next batch runs on another connection; and how every outcome settles under
 * the failure policy (retry, reject, pause). Acks and dead letters happen in consumer.c. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/log.h>

#include "backoff.h"
#include "clock.h"
#include "consumer_int.h"
#include "event.h"
#include "fault.h"
#include "mask.h"
#include "policy.h"

#define RETRY_BASE_MS 1000
#define RETRY_MAX_MS 30000

typedef enum { R_OK, R_FALLBACK, R_PAUSE } run_result;

/* The mark of the claim's transaction (set by the claim's settings, consumer_claim.c). */
#define SQL_CLAIM_MARK                                                                             \
    "SELECT pg_catalog.current_setting('idem.claim', true) IS NOT DISTINCT FROM 'on'"

void idemp_consumer_pause(idem_consumer_t *c, const char *cause, const char *detail)
{
    int64_t now = idemp_now_ms();
    int64_t wait = idemp_backoff_next(&c->pause_backoff);
    if (wait < c->pause_backoff.base_ms)
        wait = c->pause_backoff.base_ms;
    c->pause_until = now + wait;
    bool changed = strcmp(c->pause_cause, cause) != 0;
    if (c->pause_cause[0] == '\0')
        c->pause_since = now;
    snprintf(c->pause_cause, sizeof c->pause_cause, "%s", cause);
    idemp_metrics_paused(c->metrics, cause);
    /* an error line when a pause starts or its cause changes; its repeats at debug level */
    idemp_consumer_log(changed ? IDEM_LOG_ERROR : IDEM_LOG_DEBUG, c, NULL,
                       "paused (SQLSTATE %s), nothing spent or dead-lettered, trying again in "
                       "%lld ms: %s",
                       cause, (long long)wait, detail);
}

static void resumed(idem_consumer_t *c)
{
    if (c->pause_cause[0] == '\0')
        return;
    idemp_consumer_log(IDEM_LOG_INFO, c, NULL, "resumed after %.1f s paused (SQLSTATE %s)",
                       (double)(idemp_now_ms() - c->pause_since) / 1000.0, c->pause_cause);
    c->pause_cause[0] = '\0';
    idemp_backoff_reset(&c->pause_backoff);
}

/* Settles a failed try of d under policy p. */
static void settle_failure(idem_consumer_t *c, delivery_t *d, idemp_policy p, const char *why)
{
    if (why != d->detail)
        snprintf(d->detail, sizeof d->detail, "%s", why);
    idemp_metrics_add(c->metrics, IDEMP_M_CONSUMER_HANDLER_ERRORS, 1);
    if (p == IDEMP_POLICY_REJECT) {
        d->dl_code = IDEMP_DL_HANDLER_REJECTED;
        d->state = D_DEAD;
        return;
    }
    d->tries++;
    if (d->tries > c->cfg.max_retries) {
        char last[sizeof d->detail];
        snprintf(last, sizeof last, "%s", d->detail);
        snprintf(d->detail, sizeof d->detail, "%d tries, last error: %.400s", d->tries, last);
        d->dl_code = IDEMP_DL_RETRIES_EXHAUSTED;
        d->state = D_DEAD;
        return;
    }
    int64_t delay = idemp_backoff_delay(RETRY_BASE_MS, RETRY_MAX_MS, d->tries);
    d->due_ms = idemp_now_ms() + delay;
    d->state = D_WAIT;
    idemp_consumer_log(IDEM_LOG_WARN, c, d, "try %d failed, retrying in %lld ms: %.500s", d->tries,
                       (long long)delay, d->detail);
}

/* Where a try failed: before the handlers (the runtime's own statements), in a handler, or at
 * COMMIT; AT_NOT_NEW: a batch tried as all new was not (SQL_CLAIM_ALL), nothing of it committed;
 * AT_SENT: not over, its COMMIT is on its way. */
typedef enum { AT_NONE, AT_CLAIM, AT_HANDLER, AT_COMMIT, AT_NOT_NEW, AT_SENT } fail_at;

typedef struct attempt {
    int rc;
    idem_error_t err;
    fail_at at;
    delivery_t *failed; /* the delivery whose handler failed */
    idem_outcome outcome;
    char sqlstate[6]; /* of the handler's failed statement */
    bool *claimed, *stale, *conflict;
} attempt_t;

/* After a handler that had the bare connection: is its transaction still the claim's (the mark
 * the claim set, sql/008_claim_guard.sql)? A handler that ran ROLLBACK and BEGIN would otherwise
 * have its batch-mates' statements run in a transaction of its own, which no guard protects. An
 * aborted transaction (the check cannot run) counts as intact: its COMMIT is refused anyway. */
static bool claim_intact(idemp_pg_t *pg)
{
    idemp_rows_t *r = NULL;
    if (idemp_pg_exec(pg, SQL_CLAIM_MARK, 0, NULL, &r, NULL) != IDEM_OK)
        return true;
    bool ok = idemp_rows_count(r) == 1 && idemp_rows_get(r, 0, 0)[0] == 't';
    idemp_rows_free(r);
    return ok;
}

/* Runs the handlers of the claimed deliveries; stops at the first failure. */
static int handle(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, attempt_t *a)
{
    struct idem_event ev;
    for (size_t i = 0; i < n; i++) {
        if (!a->claimed[i])
            continue;
        delivery_t *d = ds[i];
        idemp_event_init(&ev, d->ev.event_id, d->ev.event_type, c->consumer, d->ev.subscription_id,
                         d->ev.payload, d->msg, pg);
        ev.has_seq = d->ev.has_seq;
        ev.seq = d->ev.seq;
        idem_outcome o = d->handler->fn(&ev, d->handler->userdata);
        idemp_amqp_keepalive(c->in); /* a slow batch must not look like a dead link */
        if (ev.pg_lost || !idemp_pg_connected(pg))
            return idem_error_set(&a->err, IDEM_ERR_PG_LOST, "connection lost in a handler: %s",
                                  ev.detail);
        if (idemp_pg_tx_ended(pg) || (ev.took_conn && !claim_intact(pg))) {
            /* it ran COMMIT (refused by sql/008's guard) or ROLLBACK itself: its claim and its
             * batch-mates' work are gone; rejected, whatever it returned */
            a->failed = d;
            a->outcome = IDEM_REJECT;
            snprintf(a->sqlstate, sizeof a->sqlstate, "%s", ev.sqlstate[0] ? ev.sqlstate : "2D000");
            snprintf(d->detail, sizeof d->detail,
                     "the handler ended the claim's transaction itself (COMMIT or ROLLBACK on its "
                     "connection; nothing of it committed)%s%.300s",
                     ev.failed ? ": " : "", ev.failed ? ev.detail : "");
            return IDEM_ERR_PG_QUERY;
        }
        /* a statement that failed through idem_event_exec decides, whatever the handler says */
        if (o != IDEM_DONE || ev.sqlstate[0] != '\0') {
            a->failed = d;
            a->outcome = o;
            snprintf(a->sqlstate, sizeof a->sqlstate, "%s", ev.sqlstate);
            snprintf(d->detail, sizeof d->detail, "%s",
                     ev.failed ? ev.detail : "handler failed without a reason");
            return IDEM_ERR_PG_QUERY;
        }
    }
    return IDEM_OK;
}

/* Did the claim of a batch tried as all new find an id that is not? */
static bool not_all_new(const attempt_t *a)
{
    return strcmp(a->err.sqlstate, IDEMP_SQLSTATE_NOT_ALL_NEW) == 0 ||
           strcmp(a->sqlstate, IDEMP_SQLSTATE_NOT_ALL_NEW) == 0;
}

/* The end of a try: committed (AT_NONE, past the fault seam between COMMIT and ack), or rolled
 * back, and then AT_NOT_NEW if all_new and the claim found an id that is not new. */
static void finished(idemp_pg_t *pg, attempt_t *a, bool all_new)
{
    if (a->rc == IDEM_OK) {
        a->at = AT_NONE;
        idemp_fault_point("consumer.after_commit");
        return;
    }
    idemp_pg_rollback(pg);
    if (all_new && a->rc != IDEM_ERR_PG_LOST && idemp_pg_connected(pg) && not_all_new(a))
        a->at = AT_NOT_NEW;
}

/* One transaction over ds[0..n): all or nothing. With all_new, a batch goes in one round trip,
 * its handlers queued behind a claim that fails it unless every id is new (SQL_CLAIM_ALL). With
 * may_send, a batch still pipelined when its handlers are done sends its COMMIT and returns at
 * once (AT_SENT): see wait_commit. */
static void attempt(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                    bool all_new, bool may_send, attempt_t *a)
{
    a->at = AT_CLAIM;
    a->rc = idemp_pg_pipeline_begin(pg, &a->err);
    if (a->rc == IDEM_OK)
        a->rc = idemp_consumer_claim(c, pg, ds, n, single, all_new, a->claimed, a->stale,
                                     a->conflict, &a->err);
    if (a->rc == IDEM_OK) {
        a->at = AT_HANDLER;
        a->rc = handle(c, pg, ds, n, a);
    }
    if (a->rc == IDEM_OK) {
        a->at = AT_COMMIT;
        idemp_fault_point("consumer.before_commit");
        if (may_send && !single && idemp_pg_pipeline_open(pg)) {
            a->rc = idemp_pg_exec(pg, SQL_CLAIM_COMMIT, 0, NULL, NULL, &a->err);
            if (a->rc == IDEM_OK)
                a->rc = idemp_pg_queue_commit(pg, &a->err);
            if (a->rc == IDEM_OK)
                a->rc = idemp_pg_pipeline_send(pg, &a->err);
            if (a->rc == IDEM_OK) {
                a->at = AT_SENT;
                return;
            }
        } else {
            a->rc = idemp_pg_commit(pg, SQL_CLAIM_COMMIT, &a->err);
        }
    }
    finished(pg, a, all_new);
}

/* The outcome of a COMMIT sent by attempt, if it has arrived (false: not yet; wait: until it
 * has, the consuming link kept alive meanwhile); finishes a as attempt would have. */
static bool commit_outcome(idem_consumer_t *c, idemp_pg_t *pg, attempt_t *a, bool wait)
{
    for (;;) {
        bool done = false;
        a->rc = idemp_pg_pipeline_poll(pg, &done, NULL, 0, &a->err);
        if (done)
            break;
        if (!wait)
            return false;
        struct pollfd pfd = {idemp_pg_socket(pg), POLLIN, 0};
        poll(&pfd, 1, 200);
        idemp_amqp_keepalive(c->in);
    }
    if (a->rc != IDEM_OK)
        a->at = AT_COMMIT; /* a handler's statement, or the COMMIT itself */
    finished(pg, a, true);
    return true;
}

/* The attempt arrays, for n deliveries; false when out of memory. */
static bool attempt_init(attempt_t *a, size_t n)
{
    memset(a, 0, sizeof *a);
    a->claimed = calloc(n, sizeof *a->claimed);
    a->stale = calloc(n, sizeof *a->stale);
    a->conflict = calloc(n, sizeof *a->conflict);
    return a->claimed != NULL && a->stale != NULL && a->conflict != NULL;
}

static void attempt_free(attempt_t *a)
{
    free(a->claimed);
    free(a->stale);
    free(a->conflict);
}

/* d's id is in the ledger with another content: dead-lettered, never taken for a duplicate (a
 * forged or reused id would otherwise hide the real event for good). */
static void collided(idem_consumer_t *c, delivery_t *d)
{
    d->dl_code = IDEMP_DL_CONFLICT;
    snprintf(d->detail, sizeof d->detail,
             "event id already applied by consumer '%.200s' with another content (event type, "
             "subscription_id or payload differ): an id collision, not a duplicate",
             c->consumer);
    d->state = D_DEAD;
    idemp_consumer_log(IDEM_LOG_ERROR, c, d,
                       "conflict: this event id was applied before with another content; the "
                       "delivery is dead-lettered to %s, not dropped as a duplicate (a forged or "
                       "reused id: compare it with what was applied before acting on it)",
                       c->dlq);
}

/* How a finished attempt over ds[0..n) settles each delivery. */
static run_result settle(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                         attempt_t *a, tx_counts_t *counts)
{
    run_result result = R_OK;
    if (a->at == AT_NONE) {
        for (size_t i = 0; i < n; i++) {
            delivery_t *d = ds[i];
            if (a->stale[i]) {
                d->dl_code = IDEMP_DL_STALE;
                snprintf(d->detail, sizeof d->detail,
                         "timestamp %lld is older than the dedup window of %lld s, by the "
                         "database clock",
                         (long long)d->ev.timestamp_s, (long long)(c->cfg.dedup_window_ms / 1000));
                d->state = D_DEAD;
            } else if (a->conflict[i]) {
                collided(c, d);
            } else {
                d->state = D_DONE;
                if (a->claimed[i])
                    counts->applied++;
                else
                    counts->duplicates++;
                idemp_metrics_event(c->metrics, d->handler->event_type,
                                    a->claimed[i] ? IDEMP_OUT_APPLIED : IDEMP_OUT_DUPLICATE);
                if (a->claimed[i] && d->ev.has_timestamp)
                    idemp_metrics_lag(c->metrics,
                                      (double)idemp_wall_us() / 1e6 - (double)d->ev.timestamp_s);
            }
        }
        resumed(c);
    } else if (a->rc == IDEM_ERR_PG_LOST || !idemp_pg_connected(pg)) {
        /* the outcome of what was in flight is unknown: redo it after reconnecting, the claim
         * absorbs whatever did commit; nothing is acked meanwhile */
        idemp_consumer_pause(c, "08006", a->err.text[0] ? a->err.text : "connection lost");
        result = R_PAUSE;
    } else if (!single) {
        idemp_consumer_log(IDEM_LOG_DEBUG, c, NULL, "batch of %zu failed, one by one: %s", n,
                           a->err.text[0] ? a->err.text : ds[0]->detail);
        result = R_FALLBACK;
    } else if (a->at == AT_CLAIM) {
        /* the runtime's own statement failed: nothing about this event is at fault */
        idemp_consumer_pause(c, a->err.sqlstate[0] ? a->err.sqlstate : "XX000", a->err.text);
        result = R_PAUSE;
    } else if (a->at == AT_HANDLER) {
        delivery_t *d = a->failed;
        idemp_policy p;
        if (a->sqlstate[0] != '\0')
            p = idemp_policy_for_handler(a->sqlstate);
        else
            p = a->outcome == IDEM_REJECT ? IDEMP_POLICY_REJECT : IDEMP_POLICY_RETRY;
        if (a->outcome == IDEM_INVALID && a->sqlstate[0] == '\0') {
            d->dl_code = IDEMP_DL_INVALID_PAYLOAD;
            d->state = D_DEAD;
        } else if (p == IDEMP_POLICY_PAUSE) {
            idemp_consumer_pause(c, a->sqlstate, d->detail);
            result = R_PAUSE;
        } else {
            snprintf(d->last_state, sizeof d->last_state, "%s", a->sqlstate);
            settle_failure(c, d, p, d->detail);
        }
    } else { /* AT_COMMIT */
        delivery_t *d = ds[0];
        idemp_policy p = a->rc == IDEM_ERR_PG_ROLLBACK ? IDEMP_POLICY_RETRY
                                                       : idemp_policy_for_commit(a->err.sqlstate);
        if (p == IDEMP_POLICY_PAUSE) {
            idemp_consumer_pause(c, a->err.sqlstate[0] ? a->err.sqlstate : "XX000", a->err.text);
            result = R_PAUSE;
        } else {
            snprintf(d->last_state, sizeof d->last_state, "%s", a->err.sqlstate);
            settle_failure(c, d, p, a->err.text);
        }
    }
    return result;
}

/* Did d's last try end on lock_timeout or statement_timeout (or a cancel)? */
static bool timed_out(const delivery_t *d)
{
    return strcmp(d->last_state, "55P03") == 0 || strcmp(d->last_state, "57014") == 0;
}

/* Stable order for the batch transaction: by subscription, then delivery order, so that
 * concurrent consumers lock rows in the same order and a subscription's events apply in order. */
static int by_subscription(const void *x, const void *y)
{
    const delivery_t *a = *(delivery_t *const *)x, *b = *(delivery_t *const *)y;
    int r = strcmp(a->ev.subscription_id, b->ev.subscription_id);
    if (r != 0)
        return r;
    return a->tag < b->tag ? -1 : a->tag > b->tag;
}

/* A batch whose COMMIT is on its way: its connection, its deliveries (in the window) and what its
 * claim found. */
struct idemp_commit {
    idemp_pg_t *pg;
    uint64_t order;  /* sent after every commit of a lower order */
    delivery_t **ds; /* owned array */
    size_t n;
    attempt_t a;
};

static void commit_free(struct idemp_commit *k)
{
    if (k == NULL)
        return;
    attempt_free(&k->a);
    free(k->ds);
    free(k);
}

/* One transaction over ds[0..n) on pg, settled; or, for a batch (sent non-NULL), its COMMIT sent
 * and the batch returned in *sent, unsettled (R_OK). all_new: try a batch in one round trip
 * first (see attempt); when it was not all new, it goes again with its claim read first. */
static run_result run(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n, bool single,
                      bool all_new, struct idemp_commit **sent, tx_counts_t *counts)
{
    struct idemp_commit *k = calloc(1, sizeof *k);
    if (k == NULL || !attempt_init(&k->a, n) ||
        (sent != NULL && !single && (k->ds = malloc(n * sizeof *k->ds)) == NULL)) {
        commit_free(k);
        idemp_consumer_pause(c, "53200", "out of memory");
        return R_PAUSE;
    }
    all_new = all_new && !single && c->claim_check;
    attempt(c, pg, ds, n, single, all_new, k->ds != NULL, &k->a);
    if (k->a.at == AT_NOT_NEW) {
        idemp_consumer_log(IDEM_LOG_DEBUG, c, NULL,
                           "batch of %zu not all new, again with its claim read first", n);
        attempt_free(&k->a);
        if (!attempt_init(&k->a, n)) {
            commit_free(k);
            idemp_consumer_pause(c, "53200", "out of memory");
            return R_PAUSE;
        }
        attempt(c, pg, ds, n, single, false, k->ds != NULL, &k->a);
    }
    if (k->a.at == AT_SENT) {
        k->pg = pg;
        k->n = n;
        memcpy(k->ds, ds, n * sizeof *ds);
        for (size_t i = 0; i < n; i++)
            ds[i]->state = D_COMMITTING;
        *sent = k;
        return R_OK;
    }
    run_result r = settle(c, pg, ds, n, single, &k->a, counts);
    commit_free(k);
    return r;
}

/* After a batch failed: one transaction per delivery; a delivery left waiting for a retry holds
 * the rest of its key (see idemp_window_key). */
static void one_by_one(idem_consumer_t *c, idemp_pg_t *pg, delivery_t **ds, size_t n,
                       tx_counts_t *counts)
{
    uint64_t *held = malloc(n * sizeof *held);
    size_t nheld = 0;
    if (held == NULL) {
        idemp_consumer_pause(c, "53200", "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        delivery_t *d = ds[i];
        if (c->cfg.stop != NULL && *c->cfg.stop)
            break; /* the rest stay unacked: the broker gives them to the next consumer */
        uint64_t k = idemp_window_key(d);
        bool behind = false;
        for (size_t j = 0; k != 0 && j < nheld && !behind; j++)
            behind = held[j] == k;
        if (behind)
            continue; /* stays as it was, behind the waiting one */
        if (run(c, pg, &ds[i], 1, true, false, NULL, counts) == R_PAUSE)
            break;
        if (d->state == D_WAIT && timed_out(d))
            break; /* a lock or a statement timeout: the others would wait as long; next turn */
        if (d->state == D_WAIT && k != 0)
            held[nheld++] = k;
    }
    free(held);
}

/* Settles the batch of commits[i], whose outcome has arrived. */
static void settle_commit(idem_consumer_t *c, int i, tx_counts_t *counts)
{
    struct idemp_commit *k = c->commits[i];
    c->commits[i] = NULL;
    for (size_t j = 0; j < k->n; j++)
        k->ds[j]->state = D_READY; /* what is not settled below goes again */
    run_result r;
    if (k->a.at == AT_NOT_NEW) { /* nothing of it committed: again, its claim read first */
        idemp_consumer_log(IDEM_LOG_DEBUG, c, NULL,
                           "batch of %zu not all new, again with its claim read first", k->n);
        r = run(c, k->pg, k->ds, k->n, false, false, NULL, counts);
    } else {
        r = settle(c, k->pg, k->ds, k->n, false, &k->a, counts);
    }
    if (r == R_FALLBACK)
        one_by_one(c, k->pg, k->ds, k->n, counts);
    commit_free(k);
}

/* The index of the oldest commit in flight, -1 when none. */
static int oldest(const idem_consumer_t *c)
{
    int o = -1;
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        if (c->commits[i] != NULL && (o < 0 || c->commits[i]->order < c->commits[o]->order))
            o = i;
    return o;
}

bool idemp_consumer_busy(const idem_consumer_t *c)
{
    return oldest(c) >= 0;
}

size_t idemp_consumer_collect(idem_consumer_t *c, bool wait, tx_counts_t *counts)
{
    size_t settled = 0;
    int o = wait ? oldest(c) : -1;
    if (o >= 0) {
        commit_outcome(c, c->commits[o]->pg, &c->commits[o]->a, true);
        settle_commit(c, o, counts);
        settled++;
    }
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++) {
        struct idemp_commit *k = c->commits[i];
        if (k != NULL && commit_outcome(c, k->pg, &k->a, false)) {
            settle_commit(c, i, counts);
            settled++;
        }
    }
    return settled;
}

void idemp_consumer_wait(idem_consumer_t *c, int64_t ms)
{
    if (idemp_amqp_buffered(c->in))
        return;
    struct pollfd pfd[1 + IDEMP_CONSUMER_CONNS];
    nfds_t n = 0;
    int fd = idemp_amqp_socket(c->in);
    if (fd >= 0)
        pfd[n++] = (struct pollfd){fd, POLLIN, 0};
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        if (c->commits[i] != NULL && (fd = idemp_pg_socket(c->commits[i]->pg)) >= 0)
            pfd[n++] = (struct pollfd){fd, POLLIN, 0};
    poll(pfd, n, (int)ms);
    idemp_amqp_keepalive(c->in);
}

/* A connection with no COMMIT on its way, or NULL. */
static idemp_pg_t *free_conn(const idem_consumer_t *c)
{
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        if (c->commits[i] == NULL)
            return c->pgs[i];
    return NULL;
}

size_t idemp_consumer_take_conn(idem_consumer_t *c, tx_counts_t *counts)
{
    size_t settled = 0;
    while ((c->pg = free_conn(c)) == NULL)
        settled += idemp_consumer_collect(c, true, counts);
    return settled;
}

void idemp_consumer_forget_inflight(idem_consumer_t *c)
{
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++) {
        struct idemp_commit *k = c->commits[i];
        if (k == NULL)
            continue;
        c->commits[i] = NULL;
        commit_outcome(c, k->pg, &k->a, true);
        commit_free(k);
    }
}

void idemp_consumer_apply(idem_consumer_t *c, delivery_t **ds, size_t n, tx_counts_t *counts)
{
    struct idemp_commit *sent = NULL;
    qsort(ds, n, sizeof *ds, by_subscription);
    if (run(c, c->pg, ds, n, n == 1, true, &sent, counts) == R_FALLBACK)
        one_by_one(c, c->pg, ds, n, counts);
    if (sent == NULL)
        return;
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        if (c->pgs[i] == c->pg) {
            sent->order = ++c->commit_order;
            c->commits[i] = sent;
        }
    c->pg = free_conn(c); /* nothing else may use the one in flight (NULL: none is free) */
}
