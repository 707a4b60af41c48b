/* cmd_consume.c - `idem consume`: the consumer runtime with the bundled billing handlers and/or
 * handlers written as SQL functions. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

#include "args.h"
#include "billing.h"

/* "0,2,3" -> list (at most IDEM_PARTITIONS_MAX distinct partitions in 0..p-1). */
static int parse_partitions(const char *spec, int p, int *list, int *n)
{
    *n = 0;
    const char *s = spec;
    while (*s != '\0') {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v >= p || (*end != ',' && *end != '\0'))
            return cli_usage_error("consume",
                                   "--partition: '%s' is not a list of partitions in "
                                   "0..%d",
                                   spec, p - 1);
        for (int i = 0; i < *n; i++)
            if (list[i] == (int)v)
                return cli_usage_error("consume", "--partition: %ld is listed twice", v);
        list[(*n)++] = (int)v;
        s = *end == ',' ? end + 1 : end;
    }
    if (*n == 0)
        return cli_usage_error("consume", "--partition needs at least one partition");
    return 0;
}

/* --handler TYPE=SCHEMA.FUNCTION entries, registered on c. */
static int register_sql(idem_consumer_t *c, const cli_list_t *handlers)
{
    for (int i = 0; i < handlers->n; i++) {
        const char *h = handlers->items[i];
        const char *eq = strchr(h, '=');
        if (eq == NULL || eq == h || eq[1] == '\0')
            return cli_usage_error("consume", "--handler: '%s' is not TYPE=SCHEMA.FUNCTION", h);
        char type[256];
        if ((size_t)(eq - h) >= sizeof type)
            return cli_usage_error("consume", "--handler: the event type is too long");
        memcpy(type, h, (size_t)(eq - h));
        type[eq - h] = '\0';
        int rc = idem_consumer_register_sql(c, type, eq + 1);
        if (rc == IDEM_ERR_INVALID)
            return cli_usage_error("consume",
                                   "--handler: '%s' is not SCHEMA.FUNCTION (plain SQL "
                                   "identifiers)",
                                   eq + 1);
        if (rc != IDEM_OK) {
            cli_error("consume", "cannot register handlers: %s", idem_strerror(rc));
            return CLI_EXIT_FAIL;
        }
    }
    return 0;
}

/* Creates the consumer (then wipes pw, which it copied), registers its handlers and runs it
 * until a stop signal. */
static int run(const idem_consumer_config_t *cfg, const cli_list_t *handlers, bool bundled,
               char *pw, size_t pwsz)
{
    idem_error_t err = {0};
    idem_consumer_t *c = idem_consumer_new(cfg, &err);
    memset(pw, 0, pwsz);
    if (c == NULL) {
        cli_error("consume", "%s", err.text);
        return err.code == IDEM_ERR_INVALID ? CLI_EXIT_USAGE : CLI_EXIT_FAIL;
    }
    int rc = 0;
    if (handlers->n == 0 || bundled) {
        rc = billing_register(c);
        if (rc != IDEM_OK) {
            cli_error("consume", "cannot register handlers: %s", idem_strerror(rc));
            rc = CLI_EXIT_FAIL;
        }
    }
    /* after the bundled ones: a --handler for one of their types replaces it */
    if (rc == 0)
        rc = register_sql(c, handlers);
    if (rc != 0) {
        idem_consumer_free(c);
        return rc;
    }
    cli_install_signals();
    cli_install_reload();
    rc = idem_consumer_run(c, &err);
    idem_consumer_free(c);
    if (rc != IDEM_OK) {
        cli_error("consume", "%s", err.text);
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}

int cmd_consume(int argc, char **argv, cli_global_t *g)
{
    idem_consumer_config_t cfg;
    idem_consumer_config_init(&cfg);
    cli_list_t binds = {{NULL}, 0}, handlers = {{NULL}, 0}, trusted = {{NULL}, 0};
    int max_bytes = (int)cfg.max_message_bytes;
    int64_t heartbeat_ms = -1;
    const char *partition_spec = NULL;
    bool bundled = false;
    const cli_opt_t opts[] = {
        {"--consumer", OPT_STRING, &cfg.consumer, "NAME", NULL,
         "consumer name in the dedup ledger (required)", 0, 0},
        {"--queue", OPT_STRING, &cfg.queue, "QUEUE", NULL,
         "durable quorum queue to consume; dead letters go to QUEUE.dlq (required)", 0, 0},
        {"--bind", OPT_LIST, &binds, "KEY", "the event types with handlers",
         "routing key to bind the queue to (repeatable)", 0, 0},
        {"--handler", OPT_LIST, &handlers, "TYPE=SCHEMA.FUNCTION", NULL,
         "handle TYPE with a SQL function (repeatable); then only these handlers run", 0, 0},
        {"--bundled", OPT_FLAG, &bundled, NULL, NULL,
         "also run the bundled billing handlers beside --handler ones", 0, 0},
        {"--prefetch", OPT_INT, &cfg.prefetch, "N", "200", "unacked deliveries in flight per queue",
         1, 65535},
        {"--batch", OPT_INT, &cfg.batch_max, "N", "100", "deliveries per transaction", 1, 10000},
        {"--linger", OPT_DURATION_MS, &cfg.linger_ms, "DURATION", "1ms",
         "wait for batch-mates after the first delivery", 0, 60},
        {"--dedup-window", OPT_DURATION, &cfg.dedup_window_ms, "DURATION", "30d",
         "deliveries older than this (by timestamp) are dead-lettered as stale", 1, 0},
        {"--max-message-bytes", OPT_INT, &max_bytes, "N", "1048576",
         "larger bodies are dead-lettered as oversized", 1, 1 << 30},
        {"--max-retries", OPT_INT, &cfg.max_retries, "N", "5",
         "retries of a transient handler failure before retries_exhausted", 0, 1000},
        CLI_OPT_HEARTBEAT(&heartbeat_ms),
        {"--partitions", OPT_INT, &cfg.partitions, "P", "1",
         "P > 1: a partitioned group QUEUE.p0..QUEUE.p<P-1> (each subscription's shard in one "
         "partition, routed by QUEUE.part) keeping per-subscription order across processes; "
         "every queue has a single active consumer, the other processes stand by",
         1, IDEM_PARTITIONS_MAX},
        {"--partition", OPT_STRING, &partition_spec, "I[,J...]", "all of them",
         "the partitions this process consumes", 0, 0},
        CLI_OPTS_TIMEOUTS(&cfg.lock_timeout_ms, &cfg.statement_timeout_ms),
        {"--no-declare", OPT_FLAG, &cfg.no_declare, NULL, NULL,
         "declare nothing on RabbitMQ; check passively that the queues and exchanges exist and "
         "that no older topology or other P is declared",
         0, 0},
        CLI_OPTS_METRICS(&cfg.metrics_port, &cfg.metrics_addr),
        {"--trusted-publisher", OPT_LIST, &trusted, "USER", "any publisher",
         "accept only messages whose user_id is this RabbitMQ user (repeatable; the relay's "
         "login user, an operator's who requeues): others are dead-lettered as untrusted",
         0, 0},
        {0},
    };
    int rc = cli_parse("consume",
                       "--consumer NAME --queue QUEUE [--bind KEY]... [--handler "
                       "TYPE=SCHEMA.FUNCTION]... [--bundled] [--prefetch N] [--batch N] "
                       "[--linger D] [--dedup-window D] [--max-message-bytes N] [--max-retries N] "
                       "[--heartbeat D] [--partitions P] [--partition I[,J...]] "
                       "[--lock-timeout D] [--statement-timeout D] [--no-declare] "
                       "[--metrics-port PORT] [--metrics-addr ADDR] [--trusted-publisher USER]...",
                       argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.consumer == NULL || cfg.consumer[0] == '\0')
        return cli_usage_error("consume", "--consumer NAME is required");
    if (cfg.queue == NULL || cfg.queue[0] == '\0')
        return cli_usage_error("consume", "--queue QUEUE is required");
    if (heartbeat_ms >= 0 && heartbeat_ms % 1000 != 0)
        return cli_usage_error("consume", "--heartbeat must be whole seconds");
    if (bundled && handlers.n == 0)
        return cli_usage_error("consume", "--bundled goes with --handler");
    int parts[IDEM_PARTITIONS_MAX];
    int nparts = 0;
    if (partition_spec != NULL) {
        if (cfg.partitions < 2)
            return cli_usage_error("consume", "--partition needs --partitions greater than 1");
        rc = parse_partitions(partition_spec, cfg.partitions, parts, &nparts);
        if (rc != 0)
            return rc;
        cfg.partition_list = parts;
        cfg.npartition_list = nparts;
    }
    bool pw_failed;
    char pw[512];
    cfg.amqp_password = cli_amqp_password(g, "consume", pw, sizeof pw, &pw_failed);
    if (pw_failed)
        return CLI_EXIT_FAIL;
    cfg.heartbeat_s = heartbeat_ms < 0 ? -1 : (int)(heartbeat_ms / 1000);
    cfg.max_message_bytes = max_bytes;
    cfg.pg_conninfo = g->pg;
    cfg.amqp_url = g->amqp;
    cfg.exchange = g->exchange;
    cfg.binds = binds.n > 0 ? binds.items : NULL;
    cfg.trusted_publishers = trusted.n > 0 ? trusted.items : NULL;
    cfg.stop = &cli_stop;
    cfg.reload = &cli_reload;
    cfg.reload_password = cli_reload_password;
    cfg.reload_userdata = g;
    cfg.sd_notify = true;

    return run(&cfg, &handlers, bundled, pw, sizeof pw);
}
