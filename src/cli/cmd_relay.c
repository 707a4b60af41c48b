/* cmd_relay.c - `idem relay`: publishes pending outbox rows with confirms. */
#include <stdio.h>
#include <string.h>

#include <idem/idem.h>

#include "args.h"

int cmd_relay(int argc, char **argv, cli_global_t *g)
{
    idem_relay_config_t cfg;
    idem_relay_config_init(&cfg);
    bool once = false;
    int64_t heartbeat_ms = -1;
    const cli_opt_t opts[] = {
        {"--once", OPT_FLAG, &once, NULL, NULL, "publish what is due, then exit", 0, 0},
        {"--batch", OPT_INT, &cfg.batch, "N", "200", "rows claimed per transaction", 1, 100000},
        {"--max-attempts", OPT_INT, &cfg.max_attempts, "N", "8",
         "nacks/returns before a row is parked as failed", 1, 1000000},
        {"--backoff-base", OPT_DURATION_MS, &cfg.backoff_base_ms, "DURATION", "1s",
         "first retry delay of a row, doubling per attempt", 0, 30 * 86400},
        {"--backoff-max", OPT_DURATION_MS, &cfg.backoff_max_ms, "DURATION", "5m",
         "longest retry delay of a row", 0, 30 * 86400},
        {"--poll-interval", OPT_DURATION_MS, &cfg.poll_interval_ms, "DURATION", "200ms",
         "backstop poll when no NOTIFY arrives", 0, 3600},
        CLI_OPT_HEARTBEAT(&heartbeat_ms),
        CLI_OPTS_TIMEOUTS(&cfg.lock_timeout_ms, &cfg.statement_timeout_ms),
        {"--no-declare", OPT_FLAG, &cfg.no_declare, NULL, NULL,
         "declare nothing on RabbitMQ; check that the exchange exists", 0, 0},
        CLI_OPTS_METRICS(&cfg.metrics_port, &cfg.metrics_addr),
        {0},
    };
    int rc = cli_parse("relay",
                       "[--once] [--batch N] [--max-attempts N] [--backoff-base D] "
                       "[--backoff-max D] [--poll-interval D] [--heartbeat D] [--lock-timeout D] "
                       "[--statement-timeout D] [--no-declare] [--metrics-port PORT] "
                       "[--metrics-addr ADDR]",
                       argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (cfg.poll_interval_ms < 1)
        return cli_usage_error("relay", "--poll-interval must be at least 1ms");
    if (cfg.backoff_max_ms < cfg.backoff_base_ms)
        return cli_usage_error("relay", "--backoff-max must not be below --backoff-base");
    if (heartbeat_ms >= 0 && heartbeat_ms % 1000 != 0)
        return cli_usage_error("relay", "--heartbeat must be whole seconds");
    bool pw_failed;
    char pw[512];
    cfg.amqp_password = cli_amqp_password(g, "relay", pw, sizeof pw, &pw_failed);
    if (pw_failed)
        return CLI_EXIT_FAIL;
    cfg.heartbeat_s = heartbeat_ms < 0 ? -1 : (int)(heartbeat_ms / 1000);
    cfg.once = once;
    cfg.pg_conninfo = g->pg;
    cfg.amqp_url = g->amqp;
    cfg.exchange = g->exchange;
    cfg.stop = &cli_stop;
    cfg.reload = &cli_reload;
    cfg.reload_password = cli_reload_password;
    cfg.reload_userdata = g;
    cfg.sd_notify = !once;

    idem_error_t err = {0};
    idem_relay_t *r = idem_relay_new(&cfg, &err);
    memset(pw, 0, sizeof pw);
    if (r == NULL) {
        cli_error("relay", "%s", err.text);
        return err.code == IDEM_ERR_INVALID ? CLI_EXIT_USAGE : CLI_EXIT_FAIL;
    }
    cli_install_signals();
    if (!once)
        cli_install_reload();
    rc = idem_relay_run(r, &err);
    idem_relay_stats_t st;
    idem_relay_get_stats(r, &st);
    idem_relay_free(r);
    if (rc != IDEM_OK) {
        cli_error("relay", "%s", err.text);
        return CLI_EXIT_FAIL;
    }
    if (once)
        printf("published %llu, failed attempts %llu, parked %llu\n",
               (unsigned long long)st.published, (unsigned long long)st.failures,
               (unsigned long long)st.parked);
    return CLI_EXIT_OK;
}
