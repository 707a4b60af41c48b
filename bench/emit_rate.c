/* emit_rate.c - the steady-rate emitter of the latency measurement: payment.failed events
 * through idem_emit, one per transaction (autocommit, durable commit), on a fixed schedule of
 * --rate events/s for --seconds, spread over --conns connections (event i is due at
 * t0 + i/rate and goes out on connection i % conns). A late event goes out at once; the
 * schedule is not stretched. C with libpq so that the load generator takes little of the
 * machine's two cores from what it measures.
 *
 *   emit_rate --run NAME [--rate 1000] [--seconds 5] [--conns 4] [--subscriptions 500]
 *             [--per-tx 1]
 *
 * With --plain TABLE, each event is the same row inserted into TABLE (a plain table of the
 * outbox's shape and indexes, made by bench.py) instead of going through idem_emit: the limit
 * idem_emit is measured against.
 *
 * With --rate 0, unpaced: every connection emits as fast as it can for --seconds.
 *
 * With --per-tx K, events go K to a transaction (BEGIN, K calls, COMMIT), the transactions at
 * --rate / K a second: events i*K .. i*K+K-1 make transaction i, which is due at t0 + i*K/rate.
 *
 * The connection comes from IDEM_PG_URL. Event i gets dedup key NAME-i, subscription
 * md5('bench-sub-' || i % subscriptions)::uuid and a billing payload carrying
 * "bench_run": NAME (bench.py finds a run's events by it). Prints one JSON line: emitted,
 * seconds, achieved_rate, max_late_ms, late_over_5ms. Exit 1 on any database error.
 *
 * Build: cc -O2 -pthread -o build/bench/emit_rate bench/emit_rate.c $(pkg-config --cflags
 * --libs libpq) */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <libpq-fe.h>

static const char *SQL =
    "SELECT idem.idem_emit('payment.failed', x.s, $2::text || '-' || $1::bigint,"
    " jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id', x.s,"
    " 'amount_cents', 4999, 'currency', 'EUR', 'reason', 'card_declined', 'bench_run', $2::text))"
    " FROM (SELECT md5('bench-sub-' || ($1::bigint % $3::int))::uuid AS s) x";

static const char *PLAIN_FMT =
    "INSERT INTO %s (event_id, subscription_id, event_type, payload)"
    " SELECT md5($2::text || '-' || $1::bigint)::uuid, x.s, 'payment.failed',"
    " jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id', x.s,"
    " 'amount_cents', 4999, 'currency', 'EUR', 'reason', 'card_declined', 'bench_run', $2::text)"
    " FROM (SELECT md5('bench-sub-' || ($1::bigint % $3::int))::uuid AS s) x";

static const char *conninfo, *run, *plain;
static char plain_sql[1024];
static double rate = 1000, seconds = 5;
static long total, nsubs = 500;
static int conns = 4, per_tx = 1;
static struct timespec t0;

typedef struct {
    int w;
    long emitted, late5;
    double max_late_ms;
    int failed;
} worker_t;

static double ts_diff(const struct timespec *a, const struct timespec *b)
{
    return (double)(a->tv_sec - b->tv_sec) + (double)(a->tv_nsec - b->tv_nsec) / 1e9;
}

static int command(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    int ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    if (!ok)
        fprintf(stderr, "emit_rate: %s: %s", sql, PQerrorMessage(c));
    PQclear(r);
    return ok;
}

static void *worker(void *arg)
{
    worker_t *wk = arg;
    PGconn *c = PQconnectdb(conninfo);
    if (PQstatus(c) != CONNECTION_OK) {
        fprintf(stderr, "emit_rate: connect: %s", PQerrorMessage(c));
        wk->failed = 1;
        PQfinish(c);
        return NULL;
    }
    PGresult *r = PQprepare(c, "emit", plain ? plain_sql : SQL, 3, NULL);
    if (PQresultStatus(r) != PGRES_COMMAND_OK) {
        fprintf(stderr, "emit_rate: prepare: %s", PQerrorMessage(c));
        wk->failed = 1;
        PQclear(r);
        PQfinish(c);
        return NULL;
    }
    PQclear(r);
    char ibuf[32], sbuf[32];
    snprintf(sbuf, sizeof sbuf, "%ld", nsubs);
    long ntx = rate > 0 ? total / per_tx : __LONG_MAX__;
    for (long t = wk->w; t < ntx && !wk->failed; t += conns) {
        if (rate <= 0) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (ts_diff(&now, &t0) >= seconds)
                break;
            goto go; /* unpaced */
        }
        double due = (double)t * per_tx / rate;
        struct timespec at = t0, now;
        long long ns = (long long)t0.tv_nsec + (long long)(due * 1e9);
        at.tv_sec += (time_t)(ns / 1000000000LL);
        at.tv_nsec = (long)(ns % 1000000000LL);
        clock_gettime(CLOCK_MONOTONIC, &now);
        double late = ts_diff(&now, &at);
        if (late < 0) {
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL);
        } else {
            if (late * 1000 > wk->max_late_ms)
                wk->max_late_ms = late * 1000;
            if (late > 0.005)
                wk->late5++;
        }
    go:
        if (per_tx > 1 && !command(c, "BEGIN")) {
            wk->failed = 1;
            break;
        }
        for (long i = t * per_tx; i < (t + 1) * per_tx; i++) {
            snprintf(ibuf, sizeof ibuf, "%ld", i);
            const char *p[] = {ibuf, run, sbuf};
            r = PQexecPrepared(c, "emit", 3, p, NULL, NULL, 0);
            if (PQresultStatus(r) != (plain ? PGRES_COMMAND_OK : PGRES_TUPLES_OK)) {
                fprintf(stderr, "emit_rate: idem_emit: %s", PQerrorMessage(c));
                wk->failed = 1;
                PQclear(r);
                break;
            }
            PQclear(r);
        }
        if (wk->failed || (per_tx > 1 && !command(c, "COMMIT"))) {
            wk->failed = 1;
            break;
        }
        wk->emitted += per_tx;
    }
    PQfinish(c);
    return NULL;
}

static void usage(void)
{
    fprintf(stderr, "usage: emit_rate --run NAME [--rate 1000] [--seconds 5] [--conns 4] "
                    "[--subscriptions 500] [--per-tx 1] [--plain TABLE]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            usage();
        if (strcmp(a, "--run") == 0)
            run = v;
        else if (strcmp(a, "--rate") == 0)
            rate = atof(v);
        else if (strcmp(a, "--seconds") == 0)
            seconds = atof(v);
        else if (strcmp(a, "--conns") == 0)
            conns = atoi(v);
        else if (strcmp(a, "--subscriptions") == 0)
            nsubs = atol(v);
        else if (strcmp(a, "--per-tx") == 0)
            per_tx = atoi(v);
        else if (strcmp(a, "--plain") == 0)
            plain = v;
        else
            usage();
        i++;
    }
    if (run == NULL || rate < 0 || seconds <= 0 || conns < 1 || conns > 64 || nsubs < 1 ||
        per_tx < 1 || per_tx > 1000)
        usage();
    if (plain != NULL) {
        for (const char *k = plain; *k; k++)
            if (!(*k == '_' || *k == '.' || (*k >= 'a' && *k <= 'z') || (*k >= '0' && *k <= '9')))
                usage(); /* an identifier of bench.py's: interpolated into the statement */
        snprintf(plain_sql, sizeof plain_sql, PLAIN_FMT, plain);
    }
    conninfo = getenv("IDEM_PG_URL");
    if (conninfo == NULL)
        conninfo = "";
    total = (long)(rate * seconds);

    worker_t *wk = calloc((size_t)conns, sizeof *wk);
    pthread_t *th = calloc((size_t)conns, sizeof *th);
    if (wk == NULL || th == NULL)
        return 1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    t0.tv_nsec += 100000000L; /* start 100 ms from now: time to connect */
    if (t0.tv_nsec >= 1000000000L) {
        t0.tv_sec++;
        t0.tv_nsec -= 1000000000L;
    }
    for (int w = 0; w < conns; w++) {
        wk[w].w = w;
        pthread_create(&th[w], NULL, worker, &wk[w]);
    }
    long emitted = 0, late5 = 0;
    double max_late = 0;
    int failed = 0;
    for (int w = 0; w < conns; w++) {
        pthread_join(th[w], NULL);
        emitted += wk[w].emitted;
        late5 += wk[w].late5;
        failed |= wk[w].failed;
        if (wk[w].max_late_ms > max_late)
            max_late = wk[w].max_late_ms;
    }
    struct timespec end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    double secs = ts_diff(&end, &t0);
    printf(
        "{\"tool\":\"emit_rate\",\"run\":\"%s\",\"target_rate\":%.1f,\"per_tx\":%d,\"emitted\":%ld,"
        "\"seconds\":%.4f,\"achieved_rate\":%.1f,\"max_late_ms\":%.2f,\"late_over_5ms\":%ld}\n",
        run, rate, per_tx, emitted, secs, secs > 0 ? (double)emitted / secs : 0.0, max_late, late5);
    free(wk);
    free(th);
    return failed ? 1 : 0;
}
