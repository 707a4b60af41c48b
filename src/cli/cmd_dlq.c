/* cmd_dlq.c - `idem dlq list|show|discard|requeue`: a consumer's dead-letter queue. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

#include "args.h"

static int usage(void)
{
    fprintf(stderr, "idem dlq: expected 'list', 'show', 'discard' or 'requeue' (see 'idem dlq "
                    "--help')\n");
    return CLI_EXIT_USAGE;
}

static void print_text(json_t *list)
{
    printf("%-36s  %-24s  %-17s  %8s  %s\n", "EVENT ID", "EVENT TYPE", "CODE", "AGE", "DETAIL");
    size_t i;
    json_t *o;
    json_array_foreach(list, i, o)
    {
        json_t *age = json_object_get(o, "age_seconds");
        char agebuf[32] = "-";
        if (json_is_integer(age))
            snprintf(agebuf, sizeof agebuf, "%llds", (long long)json_integer_value(age));
        const char *id = json_string_value(json_object_get(o, "event_id"));
        const char *type = json_string_value(json_object_get(o, "event_type"));
        const char *code = json_string_value(json_object_get(o, "code"));
        const char *detail = json_string_value(json_object_get(o, "detail"));
        /* printable only: a hostile message must not write to the operator's terminal */
        char d[200];
        size_t k = 0;
        for (const char *p = detail ? detail : "-"; *p && k + 1 < sizeof d; p++)
            d[k++] = (*p >= 0x20 && *p < 0x7f) ? *p : '?';
        d[k] = '\0';
        printf("%-36.36s  %-24.24s  %-17.17s  %8s  %s\n", id ? id : "-", type ? type : "-",
               code ? code : "-", agebuf, d);
    }
}

static int cmd_list(int argc, char **argv, cli_global_t *g)
{
    idem_dlq_config_t cfg;
    idem_dlq_config_init(&cfg);
    bool as_json = false;
    const cli_opt_t opts[] = {
        {"--queue", OPT_STRING, &cfg.queue, "QUEUE", NULL,
         "the consumer's queue; its dead letters are in QUEUE.dlq (required)", 0, 0},
        {"--json", OPT_FLAG, &as_json, NULL, NULL, "a JSON array instead of a table", 0, 0},
        {"--limit", OPT_INT, &cfg.limit, "N", "100", "show at most N messages", 1, 100000},
        {0},
    };
    int rc = cli_parse("dlq list", "--queue QUEUE [--json] [--limit N]", argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.queue == NULL || cfg.queue[0] == '\0')
        return cli_usage_error("dlq list", "--queue QUEUE is required");
    bool failed;
    char pw[512];
    cfg.amqp_password = cli_amqp_password(g, "dlq list", pw, sizeof pw, &failed);
    if (failed)
        return CLI_EXIT_FAIL;
    cfg.amqp_url = g->amqp;
    idem_error_t err = {0};
    json_t *list = NULL;
    rc = idem_dlq_list(&cfg, &list, &err);
    memset(pw, 0, sizeof pw);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem dlq list: %s\n", err.text[0] ? err.text : idem_strerror(rc));
        return CLI_EXIT_FAIL;
    }
    if (as_json) {
        char *s = json_dumps(list, JSON_COMPACT);
        if (s != NULL)
            puts(s);
        free(s);
    } else {
        print_text(list);
    }
    json_decref(list);
    return CLI_EXIT_OK;
}

/* Prints s with everything but printable ASCII (and newline, tab) as '?': a hostile message must
 * not write escape sequences to the operator's terminal. */
static void put_printable(const char *s)
{
    for (; s != NULL && *s; s++)
        putchar((*s >= 0x20 && *s < 0x7f) || *s == '\n' || *s == '\t' ? *s : '?');
}

static void print_message(json_t *o)
{
    const char *names[] = {"event_id",    "event_type", "code",        "detail",
                           "age_seconds", "requeued",   "routing_key", "body_bytes"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        json_t *v = json_object_get(o, names[i]);
        char *s = json_is_string(v) ? NULL : json_dumps(v, JSON_ENCODE_ANY);
        printf("%s: ", names[i]);
        put_printable(json_is_string(v) ? json_string_value(v) : s);
        putchar('\n');
        free(s);
    }
    const char *maps[] = {"properties", "headers"};
    for (size_t i = 0; i < 2; i++) {
        printf("%s:\n", maps[i]);
        const char *k;
        json_t *v;
        json_object_foreach(json_object_get(o, maps[i]), k, v)
        {
            char *s = json_is_string(v) ? NULL : json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            printf("  ");
            put_printable(k);
            printf(": ");
            put_printable(json_is_string(v) ? json_string_value(v) : s);
            putchar('\n');
            free(s);
        }
    }
    json_t *body = json_object_get(o, "body");
    printf("body%s:\n", json_is_true(json_object_get(o, "body_escaped")) ? " (escaped)" : "");
    put_printable(json_is_string(body) ? json_string_value(body) : "(not read)");
    putchar('\n');
}

static int cmd_show(int argc, char **argv, cli_global_t *g)
{
    idem_dlq_config_t cfg;
    idem_dlq_config_init(&cfg);
    bool as_json = false;
    const cli_opt_t opts[] = {
        {"--queue", OPT_STRING, &cfg.queue, "QUEUE", NULL,
         "the consumer's queue; its dead letters are in QUEUE.dlq (required)", 0, 0},
        {"--event-id", OPT_STRING, &cfg.event_id, "UUID", NULL, "the message to show (required)", 0,
         0},
        {"--json", OPT_FLAG, &as_json, NULL, NULL, "a JSON object instead of text", 0, 0},
        {0},
    };
    int rc = cli_parse("dlq show", "--queue QUEUE --event-id UUID [--json]", argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.queue == NULL || cfg.queue[0] == '\0')
        return cli_usage_error("dlq show", "--queue QUEUE is required");
    char canon[37];
    if (cfg.event_id == NULL)
        return cli_usage_error("dlq show", "--event-id UUID is required");
    if (!idem_uuid_normalize(cfg.event_id, canon))
        return cli_usage_error("dlq show", "--event-id: '%s' is not a UUID", cfg.event_id);
    bool failed;
    char pw[512];
    cfg.amqp_password = cli_amqp_password(g, "dlq show", pw, sizeof pw, &failed);
    if (failed)
        return CLI_EXIT_FAIL;
    cfg.amqp_url = g->amqp;
    idem_error_t err = {0};
    json_t *o = NULL;
    rc = idem_dlq_show(&cfg, &o, &err);
    memset(pw, 0, sizeof pw);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem dlq show: %s\n", err.text[0] ? err.text : idem_strerror(rc));
        return CLI_EXIT_FAIL;
    }
    if (as_json) {
        char *s = json_dumps(o, JSON_COMPACT);
        if (s != NULL)
            puts(s);
        free(s);
    } else {
        print_message(o);
    }
    json_decref(o);
    return CLI_EXIT_OK;
}

/* `dlq requeue` and `dlq discard`: the same selection, a different fate. */
static int cmd_select(int argc, char **argv, cli_global_t *g, bool requeue)
{
    const char *cmd = requeue ? "dlq requeue" : "dlq discard";
    idem_dlq_config_t cfg;
    idem_dlq_config_init(&cfg);
    bool all = false;
    const cli_opt_t opts[] = {
        {"--queue", OPT_STRING, &cfg.queue, "QUEUE", NULL,
         requeue ? "the consumer's queue; messages move from QUEUE.dlq back to it (required)"
                 : "the consumer's queue; messages are removed from QUEUE.dlq (required)",
         0, 0},
        {"--event-id", OPT_STRING, &cfg.event_id, "UUID", NULL,
         requeue ? "move this event's messages" : "remove this event's messages", 0, 0},
        {"--all", OPT_FLAG, &all, NULL, NULL,
         requeue ? "move every message (with --code: of that code)"
                 : "remove every message (with --code: of that code)",
         0, 0},
        {"--code", OPT_STRING, &cfg.code, "CODE", NULL,
         "only messages dead-lettered with this code (e.g. handler_rejected)", 0, 0},
        {0},
    };
    int rc = cli_parse(cmd, "--queue QUEUE (--event-id UUID | --all) [--code CODE]", argc, argv,
                       opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.queue == NULL || cfg.queue[0] == '\0')
        return cli_usage_error(cmd, "--queue QUEUE is required");
    if (all == (cfg.event_id != NULL))
        return cli_usage_error(cmd, "give exactly one of --event-id UUID and --all");
    char canon[37];
    if (cfg.event_id != NULL && !idem_uuid_normalize(cfg.event_id, canon))
        return cli_usage_error(cmd, "--event-id: '%s' is not a UUID", cfg.event_id);
    bool failed;
    char pw[512];
    cfg.amqp_password = cli_amqp_password(g, cmd, pw, sizeof pw, &failed);
    if (failed)
        return CLI_EXIT_FAIL;
    cfg.amqp_url = g->amqp;
    idem_error_t err = {0};
    int n = 0;
    rc = requeue ? idem_dlq_requeue(&cfg, &n, &err) : idem_dlq_discard(&cfg, &n, &err);
    memset(pw, 0, sizeof pw);
    if (requeue)
        printf("requeued %d message%s from %s.dlq to %s\n", n, n == 1 ? "" : "s", cfg.queue,
               cfg.queue);
    else
        printf("discarded %d\n", n);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem %s: %s\n", cmd, err.text[0] ? err.text : idem_strerror(rc));
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}

int cmd_dlq(int argc, char **argv, cli_global_t *g)
{
    if (argc < 2)
        return usage();
    if (strcmp(argv[1], "list") == 0)
        return cmd_list(argc - 1, argv + 1, g);
    if (strcmp(argv[1], "show") == 0)
        return cmd_show(argc - 1, argv + 1, g);
    if (strcmp(argv[1], "discard") == 0)
        return cmd_select(argc - 1, argv + 1, g, false);
    if (strcmp(argv[1], "requeue") == 0)
        return cmd_select(argc - 1, argv + 1, g, true);
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        printf("usage: idem [GLOBAL FLAGS] dlq list --queue QUEUE [--json] [--limit N]\n"
               "       idem [GLOBAL FLAGS] dlq show --queue QUEUE --event-id UUID [--json]\n"
               "       idem [GLOBAL FLAGS] dlq discard --queue QUEUE (--event-id UUID | --all) "
               "[--code CODE]\n"
               "       idem [GLOBAL FLAGS] dlq requeue --queue QUEUE (--event-id UUID | --all) "
               "[--code CODE]\n");
        return CLI_EXIT_OK;
    }
    return usage();
}
