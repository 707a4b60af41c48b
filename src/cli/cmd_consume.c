/* cmd_consume.c - `idem consume`: the consumer runtime with the bundled billing handlers. */
#include <stdio.h>

#include <idem/idem.h>

#include "args.h"
#include "billing.h"

int cmd_consume(int argc, char **argv, cli_global_t *g)
{
    idem_consumer_config_t cfg;
    idem_consumer_config_init(&cfg);
    cli_list_t binds = {{NULL}, 0};
    int max_bytes = (int)cfg.max_message_bytes;
    const cli_opt_t opts[] = {
        {"--consumer", OPT_STRING, &cfg.consumer, "NAME", NULL,
         "consumer name in the dedup ledger (required)", 0, 0},
        {"--queue", OPT_STRING, &cfg.queue, "QUEUE", NULL,
         "durable quorum queue to consume; dead letters go to QUEUE.dlq (required)", 0, 0},
        {"--bind", OPT_LIST, &binds, "KEY", "the event types with handlers",
         "routing key to bind the queue to (repeatable)", 0, 0},
        {"--prefetch", OPT_INT, &cfg.prefetch, "N", "200", "unacked deliveries in flight", 1,
         65535},
        {"--batch", OPT_INT, &cfg.batch_max, "N", "100", "deliveries per transaction", 1, 10000},
        {"--linger", OPT_DURATION_MS, &cfg.linger_ms, "DURATION", "1ms",
         "wait for batch-mates after the first delivery", 0, 0},
        {"--dedup-window", OPT_DURATION, &cfg.dedup_window_ms, "DURATION", "30d",
         "deliveries older than this (by timestamp) are dead-lettered as stale", 0, 0},
        {"--max-message-bytes", OPT_INT, &max_bytes, "N", "1048576",
         "larger bodies are dead-lettered as oversized", 1, 1 << 30},
        {"--max-retries", OPT_INT, &cfg.max_retries, "N", "5",
         "retries of a transient handler failure before retries_exhausted", 0, 1000},
        {"--metrics-port", OPT_INT, &cfg.metrics_port, "PORT", "none",
         "serve Prometheus metrics at /metrics", 1, 65535},
        {0},
    };
    int rc = cli_parse("consume",
                       "--consumer NAME --queue QUEUE [--bind KEY]... [--prefetch N] [--batch N] "
                       "[--linger D] [--dedup-window D] [--max-message-bytes N] [--max-retries N] "
                       "[--metrics-port PORT]",
                       argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.consumer == NULL || cfg.consumer[0] == '\0')
        return cli_usage_error("consume", "--consumer NAME is required");
    if (cfg.queue == NULL || cfg.queue[0] == '\0')
        return cli_usage_error("consume", "--queue QUEUE is required");
    if (cfg.dedup_window_ms <= 0)
        return cli_usage_error("consume", "--dedup-window must be positive");
    cfg.max_message_bytes = max_bytes;
    cfg.pg_conninfo = g->pg;
    cfg.amqp_url = g->amqp;
    cfg.exchange = g->exchange;
    cfg.binds = binds.n > 0 ? binds.items : NULL;
    cfg.stop = &cli_stop;

    idem_error_t err = {0};
    idem_consumer_t *c = idem_consumer_new(&cfg, &err);
    if (c == NULL) {
        fprintf(stderr, "idem consume: %s\n", err.text);
        return err.code == IDEM_ERR_INVALID ? CLI_EXIT_USAGE : CLI_EXIT_FAIL;
    }
    rc = billing_register(c);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem consume: cannot register handlers: %s\n", idem_strerror(rc));
        idem_consumer_free(c);
        return CLI_EXIT_FAIL;
    }
    cli_install_signals();
    rc = idem_consumer_run(c, &err);
    idem_consumer_free(c);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem consume: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}
