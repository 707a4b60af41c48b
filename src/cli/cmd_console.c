/* cmd_console.c - `idem console`: the operator console (the library's idem_console_run). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

#include "args.h"

/* "ADDR:PORT", "[V6ADDR]:PORT" or ":PORT" (127.0.0.1) into addr and port. */
static bool parse_listen(const char *s, char *addr, size_t sz, int *port)
{
    const char *colon = s[0] == '[' ? strstr(s, "]:") : strrchr(s, ':');
    if (colon == NULL)
        return false;
    const char *a = s[0] == '[' ? s + 1 : s, *p = colon + (s[0] == '[' ? 2 : 1);
    size_t n = (size_t)(colon - a);
    if (n >= sz)
        return false;
    memcpy(addr, a, n);
    addr[n] = '\0';
    if (n == 0)
        snprintf(addr, sz, "127.0.0.1");
    char *end;
    long v = strtol(p, &end, 10);
    if (*p == '\0' || *end != '\0' || v < 1 || v > 65535)
        return false;
    *port = (int)v;
    return true;
}

int cmd_console(int argc, char **argv, cli_global_t *g)
{
    idem_console_config_t cfg;
    idem_console_config_init(&cfg);
    const char *listen = "127.0.0.1:8080", *token_file = NULL;
    cli_list_t queues = {0};
    const cli_opt_t opts[] = {
        {"--listen", OPT_STRING, &listen, "ADDR:PORT", "127.0.0.1:8080",
         "where the page is served (a numeric address; [::1]:PORT for IPv6)", 0, 0},
        {"--queue", OPT_LIST, &queues, "QUEUE", NULL,
         "a consumer's queue whose dead letters (QUEUE.dlq) are shown; repeatable", 0, 0},
        {"--token-file", OPT_STRING, &token_file, "PATH", "none (read-only)",
         "file whose first line is the token that actions need (Authorization: Bearer TOKEN); "
         "chmod 600",
         0, 0},
        {"--max-age", OPT_DURATION, &cfg.max_age_ms, "DURATION", "5m",
         "the page warns when the oldest pending row is older than this", 0, 0},
        {"--dedup-window", OPT_DURATION, &cfg.dedup_window_ms, "DURATION", "30d",
         "the consumers' dedup window; replay refuses older rows", 0, 0},
        {"--sample-interval", OPT_DURATION, &cfg.sample_ms, "DURATION", "5s",
         "how often the backlog is sampled for the page's sparklines (the last 120 are kept)", 1,
         3600},
        {0},
    };
    int rc = cli_parse("console",
                       "[--listen ADDR:PORT] [--queue QUEUE]... [--token-file PATH] "
                       "[--max-age DURATION] [--dedup-window DURATION] [--sample-interval D]",
                       argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    char addr[64];
    if (!parse_listen(listen, addr, sizeof addr, &cfg.port))
        return cli_usage_error("console", "--listen: '%s' is not ADDR:PORT", listen);
    bool failed;
    char pw[512], token[512];
    cfg.token = cli_secret_file(token_file, "console", "token", token, sizeof token, &failed);
    if (failed)
        return CLI_EXIT_FAIL;
    if (cfg.token != NULL && strlen(cfg.token) < 16) {
        fprintf(stderr, "idem console: the token in %s is shorter than 16 characters\n",
                token_file);
        return CLI_EXIT_FAIL;
    }
    cfg.amqp_password = cli_amqp_password(g, "console", pw, sizeof pw, &failed);
    if (failed)
        return CLI_EXIT_FAIL;
    cfg.listen_addr = addr;
    cfg.queues = queues.items;
    cfg.nqueues = queues.n;
    cfg.pg_conninfo = g->pg;
    cfg.amqp_url = g->amqp;
    cfg.stop = &cli_stop;
    cfg.sd_notify = true;
    cli_install_signals();
    idem_error_t err = {0};
    rc = idem_console_run(&cfg, &err);
    memset(pw, 0, sizeof pw);
    memset(token, 0, sizeof token);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem console: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}
