/* seq_consumer.c - a consumer with a C handler that records what the public API gives it about
 * order: idem_event_subscription() and idem_event_seq(). Built and run by
 * test_x_idem_seq_on_the_wire.py.
 *
 *   IDEM_PG_URL=... IDEM_AMQP_URL=... ./seq_consumer QUEUE
 *
 * Every payment.failed event inserts (event_id, subscription, seq or NULL) into seen_c, created by
 * the test. SIGTERM: finish the batch in hand, exit 0. */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/idem.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
    stop = sig;
}

static idem_outcome on_event(idem_event_t *ev, void *userdata)
{
    (void)userdata;
    int64_t seq = 0;
    char seqtext[24];
    const char *sub = idem_event_subscription(ev);
    bool has = idem_event_seq(ev, &seq);
    snprintf(seqtext, sizeof seqtext, "%" PRId64, seq);
    const char *params[] = {idem_event_id(ev), sub, has ? seqtext : NULL};
    return idem_event_exec(ev,
                           "INSERT INTO seen_c (event_id, subscription_id, seq) "
                           "VALUES ($1, $2, $3::bigint)",
                           3, params, NULL);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s QUEUE\n", argv[0]);
        return 2;
    }
    idem_consumer_config_t cfg;
    idem_consumer_config_init(&cfg);
    cfg.consumer = "seq-c";
    cfg.queue = argv[1];
    cfg.pg_conninfo = getenv("IDEM_PG_URL");
    cfg.amqp_url = getenv("IDEM_AMQP_URL");
    cfg.stop = &stop;
    idem_error_t err = {0};
    idem_consumer_t *c = idem_consumer_new(&cfg, &err);
    if (c == NULL || idem_consumer_register(c, "payment.failed", on_event, NULL) != IDEM_OK) {
        fprintf(stderr, "seq_consumer: %s\n", c == NULL ? err.text : "cannot register");
        idem_consumer_free(c);
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    int rc = idem_consumer_run(c, &err);
    idem_consumer_free(c);
    if (rc != IDEM_OK) {
        fprintf(stderr, "seq_consumer: %s\n", err.text);
        return 1;
    }
    return 0;
}
