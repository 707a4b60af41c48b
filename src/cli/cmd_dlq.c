/* cmd_dlq.c - `idem dlq list` and `idem dlq requeue`: a consumer's dead-letter queue. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

#include "args.h"

static int usage(void)
{
    fprintf(stderr, "idem dlq: expected 'list' or 'requeue' (see 'idem dlq list --help', "
                    "'idem dlq requeue --help')\n");
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

static int cmd_requeue(int argc, char **argv, cli_global_t *g)
{
    idem_dlq_config_t cfg;
    idem_dlq_config_init(&cfg);
    bool all = false;
    const cli_opt_t opts[] = {
        {"--queue", OPT_STRING, &cfg.queue, "QUEUE", NULL,
         "the consumer's queue; messages move from QUEUE.dlq back to it (required)", 0, 0},
        {"--event-id", OPT_STRING, &cfg.event_id, "UUID", NULL, "move this event's messages", 0, 0},
        {"--all", OPT_FLAG, &all, NULL, NULL, "move every message (with --code: of that code)", 0,
         0},
        {"--code", OPT_STRING, &cfg.code, "CODE", NULL,
         "only messages dead-lettered with this code (e.g. handler_rejected)", 0, 0},
        {0},
    };
    int rc = cli_parse("dlq requeue", "--queue QUEUE (--event-id UUID | --all) [--code CODE]", argc,
                       argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.queue == NULL || cfg.queue[0] == '\0')
        return cli_usage_error("dlq requeue", "--queue QUEUE is required");
    if (all == (cfg.event_id != NULL))
        return cli_usage_error("dlq requeue", "give exactly one of --event-id UUID and --all");
    char canon[37];
    if (cfg.event_id != NULL && !idem_uuid_normalize(cfg.event_id, canon))
        return cli_usage_error("dlq requeue", "--event-id: '%s' is not a UUID", cfg.event_id);
    bool failed;
    char pw[512];
    cfg.amqp_password = cli_amqp_password(g, "dlq requeue", pw, sizeof pw, &failed);
    if (failed)
        return CLI_EXIT_FAIL;
    cfg.amqp_url = g->amqp;
    idem_error_t err = {0};
    int moved = 0;
    rc = idem_dlq_requeue(&cfg, &moved, &err);
    memset(pw, 0, sizeof pw);
    printf("requeued %d message%s from %s.dlq to %s\n", moved, moved == 1 ? "" : "s", cfg.queue,
           cfg.queue);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem dlq requeue: %s\n", err.text[0] ? err.text : idem_strerror(rc));
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
    if (strcmp(argv[1], "requeue") == 0)
        return cmd_requeue(argc - 1, argv + 1, g);
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        printf("usage: idem [GLOBAL FLAGS] dlq list --queue QUEUE [--json] [--limit N]\n"
               "       idem [GLOBAL FLAGS] dlq requeue --queue QUEUE (--event-id UUID | --all) "
               "[--code CODE]\n");
        return CLI_EXIT_OK;
    }
    return usage();
}
