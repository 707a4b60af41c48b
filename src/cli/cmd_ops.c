/* cmd_ops.c - the operator's one-shot commands: `status`, `failed`, `replay`, `retain`. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

#include "args.h"
#include "mask.h"
#include "pg.h"
#include "uuid.h"

#define STATUS_EXIT_THRESHOLD 1
#define STATUS_EXIT_UNREACHABLE 3
#define DAY_MS (24LL * 3600 * 1000)
#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))

static int fail(const char *cmd, const idem_error_t *err, int code)
{
    fprintf(stderr, "idem %s: %s\n", cmd, err->text[0] ? err->text : idem_strerror(err->code));
    return code;
}

static void print_json(json_t *doc)
{
    char *s = json_dumps(doc, JSON_FLAGS);
    if (s != NULL) {
        puts(s);
        free(s);
    }
}

/* Prints s on one line (newlines and tabs of server messages become spaces). */
static void put_oneline(const char *s)
{
    for (; s != NULL && *s; s++)
        putchar((*s == '\n' || *s == '\r' || *s == '\t') ? ' ' : *s);
}

/* "-" for null, "12.3s" otherwise. */
static void fmt_age(json_t *v, char *out, size_t sz)
{
    if (!json_is_number(v))
        snprintf(out, sz, "-");
    else
        snprintf(out, sz, "%.1fs", json_number_value(v));
}

#define STATUS_EXIT_RABBITMQ 4

static const char *str_or(json_t *v, const char *dflt)
{
    const char *s = json_string_value(v);
    return s ? s : dflt;
}

static void print_backlog(json_t *doc)
{
    json_t *types = json_object_get(doc, "event_types");
    json_t *totals = json_object_get(doc, "totals");
    json_t *ledger = json_object_get(doc, "ledger");
    char age[32];
    printf("%-32s %10s %16s %10s\n", "EVENT TYPE", "PENDING", "OLDEST PENDING", "FAILED");
    size_t i;
    json_t *t;
    json_array_foreach(types, i, t)
    {
        fmt_age(json_object_get(t, "oldest_pending_seconds"), age, sizeof age);
        printf("%-32s %10" JSON_INTEGER_FORMAT " %16s %10" JSON_INTEGER_FORMAT "\n",
               json_string_value(json_object_get(t, "event_type")),
               json_integer_value(json_object_get(t, "pending")), age,
               json_integer_value(json_object_get(t, "failed")));
    }
    fmt_age(json_object_get(totals, "oldest_pending_seconds"), age, sizeof age);
    printf("%-32s %10" JSON_INTEGER_FORMAT " %16s %10" JSON_INTEGER_FORMAT "\n", "total",
           json_integer_value(json_object_get(totals, "pending")), age,
           json_integer_value(json_object_get(totals, "failed")));
    const char *oldest = json_string_value(json_object_get(ledger, "oldest_consumed_at"));
    printf("ledger: %" JSON_INTEGER_FORMAT " rows, oldest consumed at %s\n",
           json_integer_value(json_object_get(ledger, "rows")), oldest ? oldest : "-");
}

/* "12", or "-" when v is not a number. */
static void fmt_count(json_t *v, char *out, size_t sz)
{
    if (json_is_integer(v))
        snprintf(out, sz, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    else
        snprintf(out, sz, "-");
}

static void print_consumers(json_t *doc)
{
    json_t *list = json_object_get(doc, "consumers");
    if (json_array_size(list) == 0)
        return;
    printf("\n%-20s %-14s %12s  %-24s %8s %9s %8s\n", "CONSUMER", "LAST APPLIED", "LEDGER ROWS",
           "QUEUE", "READY", "CONSUMERS", "DLQ");
    size_t i, k;
    json_t *c, *q;
    json_array_foreach(list, i, c)
    {
        char last[32], rows[24];
        json_t *ago = json_object_get(c, "last_applied_seconds");
        double a = json_is_number(ago) ? json_number_value(ago) : 0;
        if (!json_is_number(ago))
            snprintf(last, sizeof last, "never");
        else if (a < 90)
            snprintf(last, sizeof last, "%.1fs ago", a);
        else if (a < 90 * 60)
            snprintf(last, sizeof last, "%.0fm ago", a / 60);
        else if (a < 48 * 3600)
            snprintf(last, sizeof last, "%.1fh ago", a / 3600);
        else
            snprintf(last, sizeof last, "%.1fd ago", a / 86400);
        fmt_count(json_object_get(c, "ledger_rows"), rows, sizeof rows);
        const char *name = str_or(json_object_get(c, "consumer"), "-");
        json_t *queues = json_object_get(c, "queues");
        if (json_array_size(queues) == 0)
            printf("%-20s %-14s %12s  %-24s\n", name, last, rows, "-");
        json_array_foreach(queues, k, q)
        {
            char ready[24], cons[24], dlq[24];
            fmt_count(json_object_get(q, "ready"), ready, sizeof ready);
            fmt_count(json_object_get(q, "consumers"), cons, sizeof cons);
            fmt_count(json_object_get(q, "dlq_ready"), dlq, sizeof dlq);
            printf("%-20s %-14s %12s  %-24s %8s %9s %8s", k == 0 ? name : "", k == 0 ? last : "",
                   k == 0 ? rows : "", str_or(json_object_get(q, "queue"), "-"), ready, cons, dlq);
            const char *e = json_string_value(json_object_get(q, "error"));
            if (e != NULL) {
                printf("  (");
                put_oneline(e);
                putchar(')');
            }
            putchar('\n');
        }
    }
    const char *e = json_string_value(json_object_get(doc, "rabbitmq_error"));
    if (e != NULL) {
        printf("queues: ");
        put_oneline(e);
        putchar('\n');
    }
}

/* Why one pending row waits, in words. */
static void fmt_reason(json_t *row, char *out, size_t sz)
{
    const char *r = str_or(json_object_get(row, "reason"), "");
    json_int_t pid = json_integer_value(json_object_get(row, "pid"));
    json_int_t attempts = json_integer_value(json_object_get(row, "attempts"));
    json_t *next = json_object_get(row, "next_attempt_in_seconds");
    double in = json_is_number(next) ? json_number_value(next) : 0;
    if (in < 0)
        in = 0;
    char who[96];
    json_t *relay = json_object_get(row, "relay_pid");
    if (json_is_integer(relay))
        snprintf(who, sizeof who,
                 "relay pid %" JSON_INTEGER_FORMAT " (server pid %" JSON_INTEGER_FORMAT ")",
                 json_integer_value(relay), pid);
    else
        snprintf(who, sizeof who, "server pid %" JSON_INTEGER_FORMAT, pid);
    if (strcmp(r, "in_flight") == 0)
        snprintf(out, sz, "in flight on %s: its open transaction locks the row", who);
    else if (strcmp(r, "behind_in_flight") == 0)
        snprintf(out, sz, "behind row %s, in flight on %s",
                 str_or(json_object_get(row, "behind_event_id"), "-"), who);
    else if (strcmp(r, "retrying") == 0)
        snprintf(out, sz, "waiting for retry (attempt %" JSON_INTEGER_FORMAT ", next in %.1fs)",
                 attempts, in);
    else if (strcmp(r, "held") == 0)
        snprintf(out, sz,
                 "held behind a retrying row %s (attempt %" JSON_INTEGER_FORMAT ", next in %.1fs)",
                 str_or(json_object_get(row, "behind_event_id"), "-"),
                 json_integer_value(json_object_get(row, "behind_attempts")), in);
    else
        snprintf(out, sz, "due: no relay has taken it (is a relay running?)");
}

static void print_waiting(json_t *doc)
{
    json_t *pr = json_object_get(doc, "pending_rows");
    if (pr == NULL)
        return;
    json_t *by = json_object_get(pr, "by_reason");
    static const char *const names[][2] = {{"in_flight", "in flight"},
                                           {"behind_in_flight", "behind a row in flight"},
                                           {"retrying", "waiting for retry"},
                                           {"held", "held behind a retrying row"},
                                           {"due", "due, not taken by any relay"}};
    printf("\nPENDING ROWS BY REASON\n");
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        printf("  %-30s %10" JSON_INTEGER_FORMAT "\n", names[k][1],
               json_integer_value(json_object_get(by, names[k][0])));
    size_t i;
    json_t *h;
    json_array_foreach(json_object_get(pr, "holders"), i, h)
    {
        json_t *secs = json_object_get(h, "transaction_seconds");
        char open[48] = "";
        if (json_is_number(secs))
            snprintf(open, sizeof open, ", transaction open %.1fs", json_number_value(secs));
        const char *app = str_or(json_object_get(h, "application_name"), "");
        printf("  server pid %" JSON_INTEGER_FORMAT " holds %" JSON_INTEGER_FORMAT
               " rows (application %s, user %s, %s%s)\n",
               json_integer_value(json_object_get(h, "pid")),
               json_integer_value(json_object_get(h, "rows")), app[0] ? app : "-",
               str_or(json_object_get(h, "user"), "-"),
               str_or(json_object_get(h, "state"), "state not visible"), open);
    }
    json_t *rows = json_object_get(pr, "oldest");
    if (json_array_size(rows) == 0)
        return;
    printf("\n%-36s %-24s %10s  %s\n", "OLDEST PENDING", "EVENT TYPE", "AGE", "WHY IT WAITS");
    json_t *row;
    json_array_foreach(rows, i, row)
    {
        char age[32], why[256];
        fmt_age(json_object_get(row, "age_seconds"), age, sizeof age);
        fmt_reason(row, why, sizeof why);
        printf("%-36s %-24s %10s  %s\n", str_or(json_object_get(row, "event_id"), "-"),
               str_or(json_object_get(row, "event_type"), "-"), age, why);
    }
}

static void print_status_text(json_t *doc)
{
    print_backlog(doc);
    print_consumers(doc);
    print_waiting(doc);
}

int cmd_status(int argc, char **argv, cli_global_t *g)
{
    bool as_json = false;
    int64_t max_age_ms = -1;
    int rows = 10;
    cli_list_t queues = {0};
    const cli_opt_t opts[] = {
        {"--json", OPT_FLAG, &as_json, NULL, NULL,
         "print the contract's JSON document (with consumers, queues and pending_rows)", 0, 0},
        {"--max-age", OPT_DURATION, &max_age_ms, "DURATION", "none",
         "exit 1 when the oldest pending row is older than this", 0, 0},
        {"--queue", OPT_LIST, &queues, "[CONSUMER=]QUEUE", NULL,
         "also show QUEUE's and QUEUE.dlq's depths (ready messages, consumers), on CONSUMER's "
         "line; repeatable. RabbitMQ unreachable: said in the output, exit 4",
         0, 0},
        {"--rows", OPT_INT, &rows, "N", "10", "explain why the N oldest pending rows wait", 0,
         1000},
        {0},
    };
    int rc = cli_parse("status",
                       "[--json] [--max-age DURATION] [--queue [CONSUMER=]QUEUE]... "
                       "[--rows N]",
                       argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    bool failed = false;
    char pw[512];
    const char *amqp_password =
        queues.n > 0 ? cli_amqp_password(g, "status", pw, sizeof pw, &failed) : NULL;
    if (failed)
        return CLI_EXIT_FAIL;
    PGconn *conn = cli_pg_connect("status", g, STATUS_EXIT_UNREACHABLE, &rc);
    if (conn == NULL)
        return rc;
    idem_error_t err = {0};
    json_t *doc = NULL;
    rc = idem_status_query_with(conn, rows, &doc, &err);
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK)
        return fail("status", &err, STATUS_EXIT_UNREACHABLE);
    idem_error_t aerr = {0};
    int arc = idem_status_queues(doc, g->amqp, amqp_password, queues.items, queues.n, &aerr);
    memset(pw, 0, sizeof pw);
    if (as_json)
        print_json(doc);
    else
        print_status_text(doc);
    int exit_code = CLI_EXIT_OK;
    if (arc != IDEM_OK) {
        fprintf(stderr, "idem status: %s\n", aerr.text[0] ? aerr.text : idem_strerror(arc));
        exit_code = STATUS_EXIT_RABBITMQ;
    }
    json_t *oldest = json_object_get(json_object_get(doc, "totals"), "oldest_pending_seconds");
    if (max_age_ms >= 0 && json_is_number(oldest) &&
        json_number_value(oldest) * 1000.0 > (double)max_age_ms) {
        fprintf(stderr, "idem status: oldest pending row is %.1fs old, over --max-age %.0fs\n",
                json_number_value(oldest), (double)max_age_ms / 1000.0);
        exit_code = STATUS_EXIT_THRESHOLD; /* the alert wins over a broker it could not read */
    }
    json_decref(doc);
    return exit_code;
}

int cmd_failed(int argc, char **argv, cli_global_t *g)
{
    bool as_json = false;
    const cli_opt_t opts[] = {
        {"--json", OPT_FLAG, &as_json, NULL, NULL, "print a JSON array of the failed rows", 0, 0},
        {0},
    };
    int rc = cli_parse("failed", "[--json]", argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    PGconn *conn = cli_pg_connect("failed", g, CLI_EXIT_FAIL, &rc);
    if (conn == NULL)
        return rc;
    idem_error_t err = {0};
    json_t *list = NULL;
    rc = idem_failed_list(conn, &list, &err);
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK)
        return fail("failed", &err, CLI_EXIT_FAIL);
    if (as_json) {
        print_json(list);
    } else {
        size_t i;
        json_t *row;
        json_array_foreach(list, i, row)
        {
            printf("%s %s attempts=%" JSON_INTEGER_FORMAT " created_at=%s subscription_id=%s "
                   "outbox_id=%s last_error=",
                   json_string_value(json_object_get(row, "event_id")),
                   json_string_value(json_object_get(row, "event_type")),
                   json_integer_value(json_object_get(row, "attempts")),
                   json_string_value(json_object_get(row, "created_at")),
                   json_string_value(json_object_get(row, "subscription_id")),
                   json_string_value(json_object_get(row, "outbox_id")));
            const char *e = json_string_value(json_object_get(row, "last_error"));
            put_oneline(e ? e : "-");
            putchar('\n');
        }
        if (json_array_size(list) == 0)
            fprintf(stderr, "idem failed: no failed rows\n");
    }
    json_decref(list);
    return CLI_EXIT_OK;
}

int cmd_replay(int argc, char **argv, cli_global_t *g)
{
    const char *event_id = NULL;
    bool all = false;
    int64_t window_ms = 30 * DAY_MS;
    const cli_opt_t opts[] = {
        {"--event-id", OPT_STRING, &event_id, "UUID", NULL, "the failed row to replay", 0, 0},
        {"--all-failed", OPT_FLAG, &all, NULL, NULL, "replay every failed row", 0, 0},
        {"--dedup-window", OPT_DURATION, &window_ms, "DURATION", "30d",
         "the consumers' dedup window; older rows are refused", 0, 0},
        {0},
    };
    const char *synopsis = "(--event-id UUID | --all-failed) [--dedup-window DURATION]";
    int rc = cli_parse("replay", synopsis, argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if ((event_id != NULL) == all)
        return cli_usage_error("replay", "give exactly one of --event-id UUID or --all-failed");
    char id[37];
    if (event_id != NULL) {
        /* the same forms PostgreSQL's uuid accepts; checked before connecting */
        if (!idemp_uuid_normalize(event_id, strlen(event_id), id))
            return cli_usage_error("replay", "--event-id: '%s' is not a UUID", event_id);
        event_id = id;
    }
    PGconn *conn = cli_pg_connect("replay", g, CLI_EXIT_FAIL, &rc);
    if (conn == NULL)
        return rc;
    idem_error_t err = {0};
    int n = 0;
    rc = idem_replay(conn, event_id, window_ms, &n, &err);
    idemp_pgconn_close(conn);
    if (rc == IDEM_ERR_INVALID)
        return fail("replay", &err, CLI_EXIT_USAGE);
    if (rc != IDEM_OK)
        return fail("replay", &err, CLI_EXIT_FAIL);
    printf("replayed %d failed row%s: returned to pending\n", n, n == 1 ? "" : "s");
    return CLI_EXIT_OK;
}

int cmd_retain(int argc, char **argv, cli_global_t *g)
{
    idem_retain_config_t cfg;
    idem_retain_config_init(&cfg);
    const cli_opt_t opts[] = {
        {"--outbox-keep", OPT_DURATION, &cfg.outbox_keep_ms, "DURATION", "7d",
         "delete sent outbox rows older than this (by sent_at)", 0, 0},
        {"--dedup-window", OPT_DURATION, &cfg.dedup_window_ms, "DURATION", "30d",
         "the consumers' dedup window: delete ledger rows older than it plus 1d (by "
         "consumed_at; the day covers timestamps up to 1d in the future)",
         0, 0},
        {"--keys-keep", OPT_DURATION, &cfg.keys_keep_ms, "DURATION", "400d",
         "forget emitted dedup keys older than this (by first emit); a replayed emit collapses "
         "for this long",
         0, 0},
        {"--batch", OPT_INT, &cfg.batch, "N", "5000",
         "rows per DELETE statement (each its own transaction)", 1, 1000000},
        {"--force", OPT_FLAG, &cfg.force, NULL, NULL,
         "allow a dedup window shorter than the outbox window or 1d, or keys kept shorter than "
         "the dedup window",
         0, 0},
        {0},
    };
    const char *synopsis =
        "[--outbox-keep DURATION] [--dedup-window DURATION] [--keys-keep DURATION] [--batch N] "
        "[--force]";
    int rc = cli_parse("retain", synopsis, argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    idem_error_t err = {0};
    if (idem_retain_check(&cfg, &err) != IDEM_OK)
        return fail("retain", &err, CLI_EXIT_USAGE);
    PGconn *conn = cli_pg_connect("retain", g, CLI_EXIT_FAIL, &rc);
    if (conn == NULL)
        return rc;
    cli_install_signals();
    cfg.stop = &cli_stop;
    idem_retain_result_t res;
    rc = idem_retain_run(conn, &cfg, &res, &err);
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK && rc != IDEM_ERR_INTERRUPTED)
        return fail("retain", &err, CLI_EXIT_FAIL);
    if (res.skipped) {
        printf("skipped: another retention run is active\n");
        if (res.holder[0] != '\0') {
            char line[256];
            idemp_log_escape(res.holder, line, sizeof line, true);
            fprintf(stderr,
                    "idem retain: the retention lock (row 'retain' of idem.idem_leases) is held by "
                    "%s\n",
                    line);
        }
        return CLI_EXIT_OK;
    }
    printf("event_outbox: deleted %" PRId64 " rows in %" PRId64 " batches\n", res.outbox_deleted,
           res.outbox_batches);
    printf("consumed_events: deleted %" PRId64 " rows in %" PRId64 " batches\n", res.ledger_deleted,
           res.ledger_batches);
    printf("idem_emitted_keys: deleted %" PRId64 " rows in %" PRId64 " batches\n", res.keys_deleted,
           res.keys_batches);
    if (rc == IDEM_ERR_INTERRUPTED)
        fprintf(stderr, "idem retain: interrupted; stopped between batches (run again to "
                        "finish)\n");
    return CLI_EXIT_OK;
}
