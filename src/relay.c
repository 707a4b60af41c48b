/* relay.c - the outbox relay.
 *
 * One loop: claim due pending rows, publish them with confirms, mark the confirmed ones sent in
 * the claiming transaction, COMMIT. Order per subscription holds across relays because a relay
 * takes whole subscriptions (a transaction-level advisory lock per subscription) before it reads
 * their rows, and reads them with a snapshot taken after it holds the lock: whatever the
 * previous holder did is visible, and nobody else moves those rows until we commit. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <amqp.h>
#include <amqp_framing.h>

#include <idem/log.h>
#include <idem/relay.h>

#include "rmq.h"
#include "backoff.h"
#include "clock.h"
#include "fault.h"
#include "metrics.h"
#include "pg.h"

#define RECONNECT_BASE_MS 200
#define RECONNECT_MAX_MS 5000
#define GAUGE_EVERY_MS 1000

/* Step 1: the oldest due rows whose subscription no other relay holds, skipping rows that wait
 * behind a retrying row of their subscription (so they cannot crowd out other subscriptions);
 * taking the subscription's transaction-level advisory lock is what makes a row a candidate. */
#define SQL_LOCK_CANDIDATES                                                                        \
    "SELECT o.outbox_id FROM event_outbox o"                                                       \
    " WHERE o.status = 'pending' AND o.next_attempt_at <= now()"                                   \
    "   AND NOT EXISTS (SELECT 1 FROM event_outbox e"                                              \
    "                    WHERE e.subscription_id = o.subscription_id AND e.status = 'pending'"     \
    "                      AND e.attempts > 0 AND e.next_attempt_at > now() AND e.seq < o.seq)"    \
    "   AND pg_try_advisory_xact_lock(7649, hashtext(o.subscription_id::text))"                    \
    " ORDER BY o.seq LIMIT $1"

/* Step 2, with a snapshot taken after the locks are held: the candidates still pending and
 * due, minus any row behind an earlier row of its subscription that waits for a retry (only
 * rows that failed before can wait, attempts > 0: the small event_outbox_retrying index).
 * Step 1 may have skipped some of a subscription's rows while another relay still held it and
 * taken later ones after that
 * relay let go (the plan need not test the rows in emit order, so the skipped rows can be
 * anywhere), so each row also carries the seq of the previous pending row of its subscription,
 * and a subscription is published only as far as its claimed rows follow each other with no
 * pending row between them (see claim_publish).
 * The candidates are found by primary key, one LATERAL probe each (OFFSET 0 keeps the planner
 * from turning that into a walk of the whole pending index), so the cost follows the batch, not
 * the backlog. */
#define SQL_CLAIM_ROWS                                                                             \
    "SELECT o.outbox_id, o.event_id, o.subscription_id, o.event_type, o.payload::text,"            \
    "       o.attempts, extract(epoch FROM o.created_at)::bigint, o.seq,"                          \
    "       (SELECT h.seq FROM event_outbox h"                                                     \
    "         WHERE h.subscription_id = o.subscription_id AND h.status = 'pending'"                \
    "           AND h.seq < o.seq ORDER BY h.seq DESC LIMIT 1)"                                    \
    "  FROM unnest($1::uuid[]) AS c(id)"                                                           \
    "  CROSS JOIN LATERAL (SELECT * FROM event_outbox x"                                           \
    "                       WHERE x.outbox_id = c.id AND x.status = 'pending'"                     \
    "                         AND x.next_attempt_at <= now()"                                      \
    "                      OFFSET 0 FOR UPDATE SKIP LOCKED) o"                                     \
    " WHERE NOT EXISTS (SELECT 1 FROM event_outbox e"                                              \
    "                    WHERE e.subscription_id = o.subscription_id AND e.status = 'pending'"     \
    "                      AND e.attempts > 0 AND e.next_attempt_at > now() AND e.seq < o.seq)"    \
    " ORDER BY o.seq"

#define SQL_MARK_SENT                                                                              \
    "UPDATE event_outbox o SET status = 'sent', sent_at = now()"                                   \
    "  FROM unnest($1::uuid[]) AS c(id)"                                                           \
    " WHERE o.outbox_id = c.id AND o.status = 'pending'"

/* A nack or return spends one attempt; the row waits base * 2^attempts (capped) or parks. */
#define SQL_MARK_FAILED                                                                            \
    "UPDATE event_outbox o"                                                                        \
    "   SET attempts = o.attempts + 1, last_error = f.err,"                                        \
    "       status = CASE WHEN o.attempts + 1 >= $2::int THEN 'failed' ELSE 'pending' END,"        \
    "       next_attempt_at = now() + LEAST($4::float8, $3::float8 * power(2::float8,"             \
    "                         LEAST(o.attempts, 60))) * interval '1 millisecond'"                  \
    "  FROM unnest($1::uuid[], $5::text[]) AS f(id, err)"                                          \
    " WHERE o.outbox_id = f.id"                                                                    \
    " RETURNING o.outbox_id, o.event_id, o.status, o.attempts"

#define SQL_OLDEST_PENDING                                                                         \
    "SELECT extract(epoch FROM now() - created_at) FROM event_outbox"                              \
    " WHERE status = 'pending' ORDER BY seq LIMIT 1"

/* R_UNSENT: claimed, waiting for the confirm of its subscription's previous row in the batch;
 * R_HELD: not published because an earlier row of its subscription failed (it stays pending and
 * waits behind that row's retry). */
enum rstate { R_UNSENT, R_SENT_WAIT, R_ACKED, R_NACKED, R_RETURNED, R_HELD };

typedef struct row {
    char outbox_id[37], event_id[37], subscription_id[37];
    const char *event_type, *payload; /* borrowed from the claim result */
    int64_t created_s;
    uint64_t tag;
    int prev; /* index of the previous row of the same subscription in the batch, or -1 */
    enum rstate state;
} row_t;

/* A claiming transaction with its published batch. Two slots let one batch's confirms be in
 * flight while the other is claimed or committed; their subscriptions are disjoint (advisory
 * locks), so per-subscription order is unaffected. */
typedef struct slot {
    idemp_pg_t *pg;
    row_t *rows;
    size_t n;
    PGresult *res; /* owns the rows' strings while in flight */
    uint64_t last_tag;
    bool inflight;  /* transaction open, batch published, confirms pending */
    bool confirmed; /* every published row of the batch is acked, nacked or returned */
    uint64_t order; /* claim order, to settle the oldest first */
    int64_t t0, t_claim, t_pub, t_conf;
    int64_t wait_ms; /* time spent blocked on the broker's confirms */
} slot_t;

#define NSLOTS 2

struct idem_relay {
    idem_relay_config_t cfg;
    char *pg_conninfo, *amqp_url, *exchange;
    idemp_pg_t *pg; /* = slots[0].pg, which also LISTENs */
    slot_t slots[NSLOTS];
    uint64_t claims;
    idemp_amqp_t *amqp;
    idemp_metrics_t *metrics;
    idemp_backoff_t pg_backoff, amqp_backoff;
    int64_t pg_next_ms, amqp_next_ms, gauge_next_ms;
    bool pg_was_up, amqp_was_up;
    idem_relay_stats_t stats;
    volatile sig_atomic_t no_stop;
};

static const char *const LOGC = "relay";

void idem_relay_config_init(idem_relay_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->exchange = "billing.events";
    cfg->batch = 200;
    cfg->max_attempts = 8;
    cfg->backoff_base_ms = 1000;
    cfg->backoff_max_ms = 5 * 60 * 1000;
    cfg->poll_interval_ms = 200;
    cfg->confirm_timeout_ms = 30000;
}

idem_relay_t *idem_relay_new(const idem_relay_config_t *cfg, idem_error_t *err)
{
    if (cfg->batch < 1 || cfg->max_attempts < 1 || cfg->backoff_base_ms < 0 ||
        cfg->backoff_max_ms < cfg->backoff_base_ms || cfg->poll_interval_ms < 1) {
        idem_error_set(err, IDEM_ERR_INVALID, "invalid relay configuration");
        return NULL;
    }
    idem_relay_t *r = calloc(1, sizeof *r);
    if (r == NULL)
        goto nomem;
    r->cfg = *cfg;
    r->pg_conninfo = strdup(cfg->pg_conninfo ? cfg->pg_conninfo : "");
    r->amqp_url = strdup(cfg->amqp_url ? cfg->amqp_url : "amqp://guest:guest@127.0.0.1:5672");
    r->exchange = strdup(cfg->exchange ? cfg->exchange : "billing.events");
    if (!r->pg_conninfo || !r->amqp_url || !r->exchange)
        goto nomem;
    for (int i = 0; i < NSLOTS; i++) {
        r->slots[i].rows = calloc((size_t)cfg->batch, sizeof(row_t));
        r->slots[i].pg = idemp_pg_new(r->pg_conninfo);
        if (r->slots[i].rows == NULL || r->slots[i].pg == NULL)
            goto nomem;
        /* The claim's plans do not depend on its parameters (a batch size, an id array), and
         * planning it with a 200-element constant array costs more than running it.
         * The relay's commits need not wait for the disk: the event became durable at the
         * emitter's commit, and a "sent" mark lost in a crash only makes the row go out again,
         * which the consumers' ledger absorbs (exactly the crash between confirm and mark). */
        idemp_pg_set_session_sql(r->slots[i].pg, "SET plan_cache_mode = force_generic_plan; "
                                                 "SET synchronous_commit = off");
    }
    r->pg = r->slots[0].pg;
    r->amqp = idemp_amqp_new(r->amqp_url, err);
    if (r->amqp == NULL) {
        idem_relay_free(r);
        return NULL;
    }
    idemp_backoff_init(&r->pg_backoff, RECONNECT_BASE_MS, RECONNECT_MAX_MS);
    idemp_backoff_init(&r->amqp_backoff, RECONNECT_BASE_MS, RECONNECT_MAX_MS);
    return r;
nomem:
    idem_relay_free(r);
    idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    return NULL;
}

void idem_relay_free(idem_relay_t *r)
{
    if (r == NULL)
        return;
    idemp_metrics_free(r->metrics);
    idemp_amqp_free(r->amqp);
    for (int i = 0; i < NSLOTS; i++) {
        PQclear(r->slots[i].res);
        idemp_pg_free(r->slots[i].pg);
        free(r->slots[i].rows);
    }
    free(r->pg_conninfo);
    free(r->amqp_url);
    free(r->exchange);
    free(r);
}

void idem_relay_get_stats(const idem_relay_t *r, idem_relay_stats_t *out)
{
    *out = r->stats;
}

static bool stopping(const idem_relay_t *r)
{
    return r->cfg.stop != NULL && *r->cfg.stop;
}

/* ---- connections ------------------------------------------------------------------------ */

static void schedule(idemp_backoff_t *b, int64_t *next_ms, const char *what, const char *text)
{
    int64_t wait = idemp_backoff_next(b);
    wait = wait < RECONNECT_BASE_MS ? RECONNECT_BASE_MS : wait;
    *next_ms = idemp_now_ms() + wait;
    char w[32];
    snprintf(w, sizeof w, "%lld", (long long)wait);
    const char *kv[] = {"server", what, "retry_in_ms", w, NULL};
    idem_log(IDEM_LOG_WARN, LOGC, kv, "%s", text);
}

static bool pg_connected(const idem_relay_t *r)
{
    for (int i = 0; i < NSLOTS; i++)
        if (!idemp_pg_connected(r->slots[i].pg))
            return false;
    return true;
}

static void pg_disconnect(idem_relay_t *r)
{
    for (int i = 0; i < NSLOTS; i++)
        idemp_pg_disconnect(r->slots[i].pg);
}

/* Connects what is down. In once mode a failure is returned; as a daemon it is retried. */
static int ensure_connected(idem_relay_t *r, idem_error_t *err)
{
    int64_t now = idemp_now_ms();
    if (!pg_connected(r) && now >= r->pg_next_ms) {
        idem_error_t e = {0};
        if (r->pg_was_up)
            idemp_metrics_reconnect(r->metrics, IDEMP_SERVER_POSTGRES);
        int rc = IDEM_OK;
        for (int i = 0; i < NSLOTS && rc == IDEM_OK; i++)
            rc =
                idemp_pg_connected(r->slots[i].pg) ? IDEM_OK : idemp_pg_connect(r->slots[i].pg, &e);
        if (rc == IDEM_OK && !r->cfg.once)
            rc = idemp_pg_command(r->pg, "LISTEN idem_outbox", &e);
        if (rc == IDEM_OK) {
            idemp_backoff_reset(&r->pg_backoff);
            r->pg_was_up = true;
            const char *kv[] = {"server", idemp_pg_where_str(r->pg), NULL};
            idem_log(r->cfg.once ? IDEM_LOG_DEBUG : IDEM_LOG_INFO, LOGC, kv,
                     "connected to PostgreSQL");
        } else {
            pg_disconnect(r);
            if (r->cfg.once)
                return idem_error_set(err, IDEM_ERR_PG_CONNECT, "%s", e.text);
            schedule(&r->pg_backoff, &r->pg_next_ms, "postgres", e.text);
        }
    }
    if (!idemp_amqp_connected(r->amqp) && now >= r->amqp_next_ms) {
        idem_error_t e = {0};
        if (r->amqp_was_up)
            idemp_metrics_reconnect(r->metrics, IDEMP_SERVER_RABBITMQ);
        int rc = idemp_amqp_connect(r->amqp, true, &e);
        if (rc == IDEM_OK)
            rc = idemp_amqp_declare_exchange(r->amqp, r->exchange, &e);
        if (rc == IDEM_OK) {
            idemp_backoff_reset(&r->amqp_backoff);
            r->amqp_was_up = true;
            const char *kv[] = {"server", idemp_amqp_where(r->amqp), "exchange", r->exchange, NULL};
            idem_log(r->cfg.once ? IDEM_LOG_DEBUG : IDEM_LOG_INFO, LOGC, kv,
                     "connected to RabbitMQ, publishing with confirms");
        } else {
            idemp_amqp_disconnect(r->amqp);
            if (r->cfg.once)
                return idem_error_set(err, rc == IDEM_ERR_AMQP_CONNECT ? rc : IDEM_ERR_AMQP_CONNECT,
                                      "%s", e.text);
            schedule(&r->amqp_backoff, &r->amqp_next_ms, "rabbitmq", e.text);
        }
    }
    return IDEM_OK;
}

/* ---- one batch --------------------------------------------------------------------------- */

/* Appends s to a PostgreSQL array literal as a quoted element. */
static bool array_append(char **buf, size_t *len, size_t *cap, const char *s, bool first)
{
    size_t need = *len + strlen(s) * 2 + 8;
    if (need > *cap) {
        size_t ncap = *cap ? *cap : 1024;
        while (ncap < need)
            ncap *= 2;
        char *nb = realloc(*buf, ncap);
        if (nb == NULL)
            return false;
        *buf = nb;
        *cap = ncap;
    }
    char *p = *buf + *len;
    if (!first)
        *p++ = ',';
    *p++ = '"';
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            *p++ = '\\';
        *p++ = *s;
    }
    *p++ = '"';
    *p = '\0';
    *len = (size_t)(p - *buf);
    return true;
}

/* Confirms may cover rows of both in-flight batches (a multiple ack). */
static void on_confirm(void *ud, idemp_confirm_kind kind, uint64_t tag, bool multiple,
                       const amqp_message_t *m)
{
    idem_relay_t *r = ud;
    for (int k = 0; k < NSLOTS; k++) {
        slot_t *sl = &r->slots[k];
        if (!sl->inflight)
            continue;
        for (size_t i = 0; i < sl->n; i++) {
            row_t *row = &sl->rows[i];
            if (row->state != R_SENT_WAIT)
                continue;
            if (kind == IDEMP_CONFIRM_RETURN) {
                const amqp_basic_properties_t *p = &m->properties;
                if ((p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG) && p->message_id.len == 36 &&
                    memcmp(row->event_id, p->message_id.bytes, 36) == 0)
                    row->state = R_RETURNED;
            } else if (multiple ? row->tag <= tag : row->tag == tag) {
                row->state = kind == IDEMP_CONFIRM_ACK ? R_ACKED : R_NACKED;
            }
        }
    }
}

static int publish_row(idem_relay_t *r, row_t *row, idem_error_t *err)
{
    amqp_table_entry_t h[3] = {
        {amqp_cstring_bytes("event_id"), {AMQP_FIELD_KIND_UTF8, {0}}},
        {amqp_cstring_bytes("subscription_id"), {AMQP_FIELD_KIND_UTF8, {0}}},
        {amqp_cstring_bytes("event_type"), {AMQP_FIELD_KIND_UTF8, {0}}},
    };
    h[0].value.value.bytes = amqp_cstring_bytes(row->event_id);
    h[1].value.value.bytes = amqp_cstring_bytes(row->subscription_id);
    h[2].value.value.bytes = amqp_cstring_bytes(row->event_type);
    amqp_basic_properties_t props;
    memset(&props, 0, sizeof props);
    props._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
                   AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TYPE_FLAG | AMQP_BASIC_TIMESTAMP_FLAG |
                   AMQP_BASIC_HEADERS_FLAG;
    props.content_type = amqp_cstring_bytes("application/json");
    props.delivery_mode = 2;
    props.message_id = amqp_cstring_bytes(row->event_id);
    props.type = amqp_cstring_bytes(row->event_type);
    props.timestamp = (uint64_t)row->created_s;
    props.headers = (amqp_table_t){3, h};
    return idemp_amqp_publish(r->amqp, r->exchange, row->event_type, true, &props, row->payload,
                              strlen(row->payload), &row->tag, err);
}

/* Marks the batch's outcome in the open transaction. */
static int settle_rows(idem_relay_t *r, slot_t *sl, uint64_t *sent, idem_error_t *err)
{
    char *ids = NULL, *fids = NULL, *ferrs = NULL;
    size_t il = 0, ic = 0, fl = 0, fc = 0, el = 0, ec = 0;
    size_t nsent = 0, nfail = 0, n = sl->n;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        row_t *row = &sl->rows[i];
        if (row->state == R_ACKED) {
            ok = array_append(&ids, &il, &ic, row->outbox_id, nsent == 0);
            nsent++;
        } else if (row->state == R_NACKED || row->state == R_RETURNED) {
            char why[300];
            if (row->state == R_RETURNED)
                snprintf(why, sizeof why,
                         "unroutable: the broker returned it (no queue bound to exchange '%s' "
                         "for routing key '%s')",
                         r->exchange, row->event_type);
            else
                snprintf(why, sizeof why, "the broker nacked the publish");
            ok = array_append(&fids, &fl, &fc, row->outbox_id, nfail == 0) &&
                 array_append(&ferrs, &el, &ec, why, nfail == 0);
            nfail++;
        }
    }
    int rc = ok ? IDEM_OK : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    char *lit = NULL;
    if (rc == IDEM_OK && nsent > 0) {
        lit = malloc(il + 3);
        if (lit == NULL)
            rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        else {
            snprintf(lit, il + 3, "{%s}", ids);
            const char *p[] = {lit};
            PGresult *res;
            rc = idemp_pg_exec(sl->pg, SQL_MARK_SENT, 1, p, &res, err);
            if (rc == IDEM_OK) {
                *sent = strtoull(PQcmdTuples(res), NULL, 10);
                PQclear(res);
            }
        }
    }
    if (rc == IDEM_OK && nfail > 0) {
        char *l1 = malloc(fl + 3), *l2 = malloc(el + 3);
        char att[16], base[32], max[32];
        snprintf(att, sizeof att, "%d", r->cfg.max_attempts);
        snprintf(base, sizeof base, "%lld", (long long)r->cfg.backoff_base_ms);
        snprintf(max, sizeof max, "%lld", (long long)r->cfg.backoff_max_ms);
        if (l1 == NULL || l2 == NULL) {
            rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        } else {
            snprintf(l1, fl + 3, "{%s}", fids);
            snprintf(l2, el + 3, "{%s}", ferrs);
            const char *p[] = {l1, att, base, max, l2};
            PGresult *res;
            rc = idemp_pg_exec(sl->pg, SQL_MARK_FAILED, 5, p, &res, err);
            for (int i = 0; rc == IDEM_OK && i < PQntuples(res); i++) {
                const char *status = PQgetvalue(res, i, 2);
                bool parked = strcmp(status, "failed") == 0;
                const char *kv[] = {
                    "outbox_id", PQgetvalue(res, i, 0), "event_id", PQgetvalue(res, i, 1),
                    "attempts",  PQgetvalue(res, i, 3), NULL};
                const char *why = "";
                for (size_t j = 0; j < n; j++)
                    if (strcmp(sl->rows[j].outbox_id, PQgetvalue(res, i, 0)) == 0)
                        why = sl->rows[j].state == R_RETURNED ? "returned as unroutable"
                                                              : "nacked by the broker";
                if (parked) {
                    r->stats.parked++;
                    idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PARKED, 1);
                    idem_log(IDEM_LOG_ERROR, LOGC, kv,
                             "event parked as failed after max attempts: %s", why);
                } else {
                    idem_log(IDEM_LOG_WARN, LOGC, kv, "publish failed, will retry: %s", why);
                }
            }
            if (rc == IDEM_OK)
                PQclear(res);
        }
        free(l1);
        free(l2);
        r->stats.failures += nfail;
        idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISH_FAILURES, nfail);
    }
    free(lit);
    free(ids);
    free(fids);
    free(ferrs);
    return rc;
}

/* Rolls back every open batch: nothing is spent, the rows stay pending and come again (the
 * consumer deduplicates what the broker already has). */
static void abort_all(idem_relay_t *r)
{
    for (int k = 0; k < NSLOTS; k++) {
        slot_t *sl = &r->slots[k];
        if (sl->inflight && idemp_pg_connected(sl->pg)) {
            idem_error_t rb = {0};
            idemp_pg_command(sl->pg, "ROLLBACK", &rb);
        }
        PQclear(sl->res);
        sl->res = NULL;
        sl->inflight = false;
        sl->n = 0;
    }
}

/* Publishes every row whose subscription has no earlier row in the batch still unconfirmed;
 * a row behind a failed (or held) row is held. Rows of distinct subscriptions all go in the
 * first wave; a subscription's next row goes only once the broker has confirmed its previous
 * one, so a returned or nacked event is never overtaken by a later event of its subscription. */
static int publish_wave(idem_relay_t *r, slot_t *sl, size_t *published, idem_error_t *err)
{
    *published = 0;
    for (size_t i = 0; i < sl->n; i++) {
        row_t *row = &sl->rows[i];
        if (row->state != R_UNSENT)
            continue;
        enum rstate before = row->prev < 0 ? R_ACKED : sl->rows[row->prev].state;
        if (before == R_UNSENT || before == R_SENT_WAIT)
            continue; /* next wave */
        if (before != R_ACKED) {
            row->state = R_HELD;
            continue;
        }
        int rc = publish_row(r, row, err);
        if (rc != IDEM_OK)
            return rc;
        row->state = R_SENT_WAIT;
        sl->last_tag = row->tag;
        (*published)++;
    }
    return IDEM_OK;
}

/* Claims a batch into sl and publishes it (confirms still pending). *claimed = rows claimed. */
static int claim_publish(idem_relay_t *r, slot_t *sl, size_t *claimed, idem_error_t *err)
{
    char limit[16];
    snprintf(limit, sizeof limit, "%d", r->cfg.batch);
    PGresult *cands = NULL, *res = NULL;
    *claimed = 0;
    sl->t0 = idemp_now_ms();

    int rc = idemp_pg_command(sl->pg, "BEGIN", err);
    if (rc == IDEM_OK) {
        const char *p[] = {limit};
        rc = idemp_pg_exec(sl->pg, SQL_LOCK_CANDIDATES, 1, p, &cands, err);
    }
    if (rc == IDEM_OK && PQntuples(cands) == 0) {
        PQclear(cands);
        return idemp_pg_command(sl->pg, "COMMIT", err);
    }
    if (rc == IDEM_OK) {
        char *lit = NULL;
        size_t len = 0, cap = 0;
        bool ok = true;
        for (int i = 0; i < PQntuples(cands) && ok; i++)
            ok = array_append(&lit, &len, &cap, PQgetvalue(cands, i, 0), i == 0);
        char *arr = ok ? malloc(len + 3) : NULL;
        if (arr == NULL) {
            rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        } else {
            snprintf(arr, len + 3, "{%s}", lit);
            const char *p[] = {arr};
            rc = idemp_pg_exec(sl->pg, SQL_CLAIM_ROWS, 1, p, &res, err);
        }
        free(arr);
        free(lit);
    }
    PQclear(cands);
    sl->t_claim = idemp_now_ms();
    if (rc != IDEM_OK) {
        PQclear(res);
        return rc;
    }

    size_t rows = (size_t)PQntuples(res), n = 0;
    bool *keep = calloc(rows ? rows : 1, sizeof *keep);
    if (keep == NULL) {
        PQclear(res);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < rows && n < (size_t)r->cfg.batch; k++) {
        int i = (int)k;
        /* a subscription goes out only as a run of consecutive pending rows from its first one:
         * a row is kept if the pending row before it is the previous kept row of its
         * subscription (none for the first); after a gap the rest waits for a later claim */
        const char *sub = PQgetvalue(res, i, 2);
        const char *prev_pending = PQgetisnull(res, i, 8) ? NULL : PQgetvalue(res, i, 8);
        const char *prev_kept = NULL;
        bool broken = false;
        for (size_t j = 0; j < k; j++)
            if (strcmp(PQgetvalue(res, (int)j, 2), sub) == 0) {
                if (keep[j])
                    prev_kept = PQgetvalue(res, (int)j, 7);
                else
                    broken = true;
            }
        bool follows = prev_kept == NULL
                           ? prev_pending == NULL
                           : prev_pending != NULL && strcmp(prev_pending, prev_kept) == 0;
        if (broken || !follows) {
            const char *kv[] = {"subscription_id", sub, "event_id", PQgetvalue(res, i, 1), NULL};
            idem_log(IDEM_LOG_DEBUG, LOGC, kv,
                     "left for a later claim: an earlier pending row of its subscription was "
                     "not claimed");
            continue;
        }
        keep[k] = true;
        row_t *row = &sl->rows[n++];
        snprintf(row->outbox_id, sizeof row->outbox_id, "%s", PQgetvalue(res, i, 0));
        snprintf(row->event_id, sizeof row->event_id, "%s", PQgetvalue(res, i, 1));
        snprintf(row->subscription_id, sizeof row->subscription_id, "%s", sub);
        row->event_type = PQgetvalue(res, i, 3);
        row->payload = PQgetvalue(res, i, 4);
        row->created_s = strtoll(PQgetvalue(res, i, 6), NULL, 10);
        row->state = R_UNSENT;
        row->prev = -1;
        for (size_t j = n - 1; j-- > 0;)
            if (memcmp(sl->rows[j].subscription_id, row->subscription_id, 36) == 0) {
                row->prev = (int)j;
                break;
            }
    }
    free(keep);
    sl->res = res;
    sl->n = n;
    sl->confirmed = false;
    sl->wait_ms = 0;
    sl->inflight = true; /* from here the transaction is open until settle or abort */
    sl->order = ++r->claims;
    *claimed = n;
    if (n == 0)
        return IDEM_OK; /* every candidate was taken meanwhile: settle commits the empty batch */

    /* publish the first wave; its confirms are awaited in confirm_slot */
    size_t published;
    rc = publish_wave(r, sl, &published, err);
    sl->t_pub = idemp_now_ms();
    return rc;
}

/* Waits for sl's confirms, publishing the next wave each time, until the batch is settled. */
static int confirm_slot(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    int rc = IDEM_OK;
    size_t published = sl->n > 0 && !sl->confirmed ? 1 : 0;
    while (rc == IDEM_OK && published > 0) {
        int64_t w0 = idemp_now_ms();
        rc = idemp_amqp_wait_confirms(r->amqp, sl->last_tag, r->cfg.confirm_timeout_ms, on_confirm,
                                      r, err);
        sl->wait_ms += idemp_now_ms() - w0;
        if (rc == IDEM_OK)
            rc = publish_wave(r, sl, &published, err);
    }
    if (rc == IDEM_OK) {
        sl->confirmed = true;
        sl->t_conf = idemp_now_ms();
    }
    return rc;
}

/* Marks sl's rows by their confirms and commits; its confirms must be in (confirm_slot). */
static int commit_slot(idem_relay_t *r, slot_t *sl, idem_error_t *err)
{
    int rc = confirm_slot(r, sl, err);
    int64_t t_conf = sl->t_conf;
    uint64_t sent = 0;
    if (rc == IDEM_OK) {
        size_t acked = 0;
        for (size_t i = 0; i < sl->n; i++)
            acked += sl->rows[i].state == R_ACKED;
        if (acked > 0)
            idemp_fault_point("relay.after_publish");
        rc = settle_rows(r, sl, &sent, err);
    }
    if (rc == IDEM_OK)
        rc = idemp_pg_command(sl->pg, "COMMIT", err);
    if (rc != IDEM_OK)
        return rc; /* the caller aborts every open batch */
    size_t n = sl->n;
    PQclear(sl->res); /* rows[] borrowed strings from res: done with them now */
    sl->res = NULL;
    sl->inflight = false;
    sl->n = 0;

    r->stats.published += sent;
    r->stats.batches++;
    idemp_metrics_add(r->metrics, IDEMP_M_RELAY_PUBLISHED, sent);
    idemp_metrics_batch_duration(r->metrics, (double)(idemp_now_ms() - sl->t0) / 1000.0);
    if (n > 0) {
        char a[24], b[24], c1[24], d[24], e[24], f[24];
        snprintf(a, sizeof a, "%zu", n);
        snprintf(b, sizeof b, "%llu", (unsigned long long)sent);
        snprintf(c1, sizeof c1, "%lld", (long long)(sl->t_claim - sl->t0));
        snprintf(d, sizeof d, "%lld", (long long)(sl->t_pub - sl->t_claim));
        snprintf(e, sizeof e, "%lld", (long long)sl->wait_ms);
        snprintf(f, sizeof f, "%lld", (long long)(idemp_now_ms() - t_conf));
        const char *kv[] = {
            "claimed",         a, "sent",           b, "claim_ms", c1, "publish_ms", d,
            "confirm_wait_ms", e, "mark_commit_ms", f, NULL};
        idem_log(IDEM_LOG_DEBUG, LOGC, kv, "batch committed");
    }
    return IDEM_OK;
}

/* The free slot to claim into, or NULL. */
static slot_t *free_slot(idem_relay_t *r)
{
    for (int k = 0; k < NSLOTS; k++)
        if (!r->slots[k].inflight)
            return &r->slots[k];
    return NULL;
}

/* The in-flight slot claimed first, or NULL. */
static slot_t *oldest_inflight(idem_relay_t *r)
{
    slot_t *best = NULL;
    for (int k = 0; k < NSLOTS; k++)
        if (r->slots[k].inflight && (best == NULL || r->slots[k].order < best->order))
            best = &r->slots[k];
    return best;
}

/* ---- the loop ---------------------------------------------------------------------------- */

static void update_gauge(idem_relay_t *r)
{
    if (r->metrics == NULL || idemp_now_ms() < r->gauge_next_ms)
        return;
    r->gauge_next_ms = idemp_now_ms() + GAUGE_EVERY_MS;
    PGresult *res;
    idem_error_t e = {0};
    if (idemp_pg_exec(r->pg, SQL_OLDEST_PENDING, 0, NULL, &res, &e) != IDEM_OK)
        return;
    idemp_metrics_oldest_pending(r->metrics,
                                 PQntuples(res) ? strtod(PQgetvalue(res, 0, 0), NULL) : 0.0);
    PQclear(res);
}

/* Drains queued notifications; true if any arrived. */
static bool drain_notifies(idem_relay_t *r)
{
    PGconn *conn = idemp_pg_conn(r->pg);
    bool any = false;
    if (conn == NULL)
        return false;
    PQconsumeInput(conn);
    PGnotify *nt;
    while ((nt = PQnotifies(conn)) != NULL) {
        any = true;
        PQfreemem(nt);
    }
    return any;
}

/* Sleeps until a NOTIFY arrives or the poll interval passes (or a stop). */
static void wait_for_work(idem_relay_t *r)
{
    /* a NOTIFY that arrived during our own statements is already in libpq's queue, and the
     * socket will not signal it again */
    if (drain_notifies(r))
        return;
    int64_t end = idemp_now_ms() + r->cfg.poll_interval_ms;
    while (!stopping(r)) {
        int64_t left = end - idemp_now_ms();
        if (left <= 0)
            return;
        PGconn *conn = idemp_pg_conn(r->pg);
        if (conn == NULL)
            return;
        struct pollfd pfd = {PQsocket(conn), POLLIN, 0};
        int n = poll(&pfd, 1, (int)(left > 100 ? 100 : left));
        if (n > 0) {
            if (!PQconsumeInput(conn)) {
                idemp_pg_disconnect(r->pg);
                return;
            }
            if (drain_notifies(r))
                return;
        }
    }
}

int idem_relay_run(idem_relay_t *r, idem_error_t *err)
{
    if (r->cfg.stop == NULL)
        r->cfg.stop = &r->no_stop;
    if (r->cfg.metrics_port > 0) {
        r->metrics = idemp_metrics_new(IDEMP_ROLE_RELAY);
        if (r->metrics == NULL)
            return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        int rc = idemp_metrics_serve(r->metrics, r->cfg.metrics_port, err);
        if (rc != IDEM_OK)
            return rc;
    }
    /* a one-shot run reports through its exit status and summary, not lifecycle lines */
    idem_log_level life = r->cfg.once ? IDEM_LOG_DEBUG : IDEM_LOG_INFO;
    idem_log(life, LOGC, NULL, "starting%s", r->cfg.once ? " (once)" : "");
    int result = IDEM_OK;
    slot_t *sl;
    while (!stopping(r)) {
        int rc = ensure_connected(r, err);
        if (rc != IDEM_OK) {
            result = rc;
            break;
        }
        if (!pg_connected(r) || !idemp_amqp_connected(r->amqp)) {
            idemp_sleep_ms(50, r->cfg.stop);
            continue;
        }
        if (oldest_inflight(r) == NULL)
            update_gauge(r);
        drain_notifies(r);
        idem_error_t e = {0};
        /* The oldest batch is confirmed by the broker, then the next one is claimed and
         * published, then the oldest is marked and committed: the broker works on batch k+1
         * while PostgreSQL commits batch k. */
        bool claimed_any = false;
        rc = IDEM_OK;
        slot_t *cur = oldest_inflight(r);
        if (cur == NULL) {
            size_t claimed = 0;
            cur = free_slot(r);
            rc = claim_publish(r, cur, &claimed, &e);
            claimed_any = claimed > 0;
            if (rc == IDEM_OK && !cur->inflight)
                cur = NULL; /* nothing due */
        }
        if (rc == IDEM_OK && cur != NULL)
            rc = confirm_slot(r, cur, &e);
        slot_t *next = rc == IDEM_OK && cur != NULL && !stopping(r) ? free_slot(r) : NULL;
        if (next != NULL) {
            size_t claimed = 0;
            rc = claim_publish(r, next, &claimed, &e);
            claimed_any = claimed_any || claimed > 0;
        }
        if (rc == IDEM_OK && cur != NULL)
            rc = commit_slot(r, cur, &e);
        if (rc != IDEM_OK) {
            abort_all(r);
            bool pg_side = rc == IDEM_ERR_PG_LOST || rc == IDEM_ERR_PG_QUERY;
            const char *kv[] = {"server", pg_side ? "postgres" : "rabbitmq", NULL};
            if (r->cfg.once) {
                idem_error_set(err, rc, "%s", e.text);
                result = rc;
                break;
            }
            idem_log(IDEM_LOG_WARN, LOGC, kv, "batch abandoned, nothing spent: %s", e.text);
            if (pg_side && !pg_connected(r)) {
                pg_disconnect(r);
                schedule(&r->pg_backoff, &r->pg_next_ms, "postgres", "reconnecting");
            } else if (pg_side) {
                idemp_sleep_ms(RECONNECT_BASE_MS, r->cfg.stop);
            } else {
                idemp_amqp_disconnect(r->amqp);
                schedule(&r->amqp_backoff, &r->amqp_next_ms, "rabbitmq", "reconnecting");
            }
            continue;
        }
        if (claimed_any || oldest_inflight(r) != NULL)
            continue; /* more is probably due */
        if (r->cfg.once)
            break;
        wait_for_work(r);
    }
    /* a stop between claim and settle: finish what was published (its confirms, mark, commit) */
    while ((sl = oldest_inflight(r)) != NULL) {
        idem_error_t e = {0};
        if (commit_slot(r, sl, &e) != IDEM_OK) {
            abort_all(r);
            break;
        }
    }
    {
        char a[24], b[24], c1[24];
        snprintf(a, sizeof a, "%llu", (unsigned long long)r->stats.published);
        snprintf(b, sizeof b, "%llu", (unsigned long long)r->stats.failures);
        snprintf(c1, sizeof c1, "%llu", (unsigned long long)r->stats.parked);
        const char *kv[] = {"published", a, "failures", b, "parked", c1, NULL};
        idem_log(life, LOGC, kv, "stopped");
    }
    idemp_amqp_disconnect(r->amqp);
    pg_disconnect(r);
    return result;
}
