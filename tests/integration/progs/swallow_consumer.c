/* swallow_consumer.c - a consumer with two handlers, for test_swallowed_error_is_never_acked.py.
 *
 *   swallow_consumer QUEUE METRICS_PORT MAX_RETRIES      (IDEM_PG_URL, IDEM_AMQP_URL)
 *
 * Consumer name "swallow". Event types:
 *   it.swallow  takes the bare connection, runs a statement that fails (SELECT 1/0), ignores the
 *               error and returns IDEM_DONE: the transaction is aborted, so COMMIT cannot apply it.
 *   it.swallow_exec
 *               runs SELECT it_raise($1) through idem_event_exec, $1 being the payload's "code"
 *               (the test's it_raise raises that SQLSTATE), ignores the failure it reports and
 *               returns IDEM_DONE: the consumer must apply its failure policy to the recorded
 *               SQLSTATE whatever the handler returns (idem/handler.h).
 *   it.apply    a well-behaved handler: one row in it_applied through idem_event_exec.
 * SIGTERM/SIGINT stop it after the batch in hand (exit 0). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idem/idem.h>

#define SQL_APPLY "INSERT INTO it_applied (event_id, subscription_id) VALUES ($1::uuid, $2::uuid)"

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
    if (stop)
        _exit(1);
    stop = sig;
}

static idem_outcome on_swallow(idem_event_t *ev, void *userdata)
{
    (void)userdata;
    PGconn *conn = idem_event_conn(ev);
    if (conn == NULL)
        return idem_event_fail(ev, IDEM_RETRY, "no connection");
    PGresult *res = PQexec(conn, "SELECT 1/0");
    /* the error (22012) is ignored on purpose */
    PQclear(res);
    return IDEM_DONE;
}

static idem_outcome on_swallow_exec(idem_event_t *ev, void *userdata)
{
    (void)userdata;
    const char *code = json_string_value(json_object_get(idem_event_payload(ev), "code"));
    const char *params[] = {code ? code : "22012"};
    PGresult *res = NULL;
    /* with out, the statement runs now (never queued); its outcome is ignored on purpose */
    (void)idem_event_exec(ev, "SELECT it_raise($1)", 1, params, &res);
    PQclear(res);
    return IDEM_DONE;
}

static idem_outcome on_apply(idem_event_t *ev, void *userdata)
{
    (void)userdata;
    const char *sub = idem_event_subscription(ev);
    if (sub == NULL)
        return idem_event_fail(ev, IDEM_INVALID, "subscription_id: not a UUID");
    const char *params[] = {idem_event_id(ev), sub};
    return idem_event_exec(ev, SQL_APPLY, 2, params, NULL);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s QUEUE METRICS_PORT MAX_RETRIES\n", argv[0]);
        return 2;
    }
    idem_consumer_config_t cfg;
    idem_consumer_config_init(&cfg);
    cfg.consumer = "swallow";
    cfg.queue = argv[1];
    cfg.metrics_port = atoi(argv[2]);
    cfg.max_retries = atoi(argv[3]);
    cfg.pg_conninfo = getenv("IDEM_PG_URL");
    cfg.amqp_url = getenv("IDEM_AMQP_URL");
    cfg.stop = &stop;

    idem_error_t err = {0};
    idem_consumer_t *c = idem_consumer_new(&cfg, &err);
    if (c == NULL) {
        fprintf(stderr, "swallow_consumer: %s\n", err.text);
        return 1;
    }
    if (idem_consumer_register(c, "it.swallow", on_swallow, NULL) != IDEM_OK ||
        idem_consumer_register(c, "it.swallow_exec", on_swallow_exec, NULL) != IDEM_OK ||
        idem_consumer_register(c, "it.apply", on_apply, NULL) != IDEM_OK) {
        fprintf(stderr, "swallow_consumer: cannot register the handlers\n");
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
        fprintf(stderr, "swallow_consumer: %s\n", err.text);
        return 1;
    }
    return 0;
}
