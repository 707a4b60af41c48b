/* txn_ender_consumer.c - a consumer whose handlers end the claim's transaction themselves, for
 * test_handler_ends_the_transaction.py.
 *
 *   txn_ender_consumer QUEUE METRICS_PORT      (IDEM_PG_URL, IDEM_AMQP_URL)
 *
 * Consumer name "ender". Every handler first writes its effect (a row in it_applied), then:
 *   it.c_rollback        ROLLBACK on the bare connection (idem_event_conn), returns IDEM_DONE
 *   it.c_commit          COMMIT on the bare connection, returns IDEM_DONE
 *   it.c_rollback_begin  ROLLBACK, BEGIN and its effect again on the bare connection, IDEM_DONE
 *   it.exec_commit       COMMIT through idem_event_exec, returns IDEM_DONE whatever it reported
 *   it.exec_rollback     ROLLBACK through idem_event_exec, returns IDEM_DONE
 *   it.exec_async        set_config('synchronous_commit', 'off', false) through idem_event_exec
 *   it.apply             nothing more: a well-behaved handler
 * SIGTERM/SIGINT stop it after the batch in hand (exit 0). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idem/idem.h>

#define SQL_APPLY "INSERT INTO it_applied (event_id, kind) VALUES ($1::uuid, $2)"

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
    if (stop)
        _exit(1);
    stop = sig;
}

static idem_outcome effect(idem_event_t *ev)
{
    const char *params[] = {idem_event_id(ev), idem_event_type(ev)};
    return idem_event_exec(ev, SQL_APPLY, 2, params, NULL);
}

/* Runs sql on the bare connection; its outcome is ignored on purpose. */
static void bare(idem_event_t *ev, const char *sql)
{
    PGconn *conn = idem_event_conn(ev);
    PQclear(PQexec(conn, sql));
}

static idem_outcome on_event(idem_event_t *ev, void *userdata)
{
    (void)userdata;
    const char *t = idem_event_type(ev);
    idem_outcome o = effect(ev);
    if (o != IDEM_DONE)
        return o;
    if (strcmp(t, "it.c_rollback") == 0) {
        bare(ev, "ROLLBACK");
    } else if (strcmp(t, "it.c_commit") == 0) {
        bare(ev, "COMMIT");
    } else if (strcmp(t, "it.c_rollback_begin") == 0) {
        bare(ev, "ROLLBACK");
        bare(ev, "BEGIN");
        const char *params[] = {idem_event_id(ev)};
        PQclear(PQexecParams(idem_event_conn(ev),
                             "INSERT INTO it_applied (event_id, kind) VALUES ($1::uuid, "
                             "'after-begin')",
                             1, NULL, params, NULL, NULL, 0));
    } else if (strcmp(t, "it.exec_commit") == 0) {
        (void)idem_event_exec(ev, "COMMIT", 0, NULL, NULL);
    } else if (strcmp(t, "it.exec_rollback") == 0) {
        (void)idem_event_exec(ev, "ROLLBACK", 0, NULL, NULL);
    } else if (strcmp(t, "it.exec_async") == 0) {
        (void)idem_event_exec(ev, "SELECT set_config('synchronous_commit', 'off', false)", 0, NULL,
                              NULL);
    }
    return IDEM_DONE;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE METRICS_PORT\n", argv[0]);
        return 2;
    }
    idem_consumer_config_t cfg;
    idem_consumer_config_init(&cfg);
    cfg.consumer = "ender";
    cfg.queue = argv[1];
    cfg.metrics_port = atoi(argv[2]);
    cfg.max_retries = 1;
    cfg.pg_conninfo = getenv("IDEM_PG_URL");
    cfg.amqp_url = getenv("IDEM_AMQP_URL");
    cfg.stop = &stop;

    idem_error_t err = {0};
    idem_consumer_t *c = idem_consumer_new(&cfg, &err);
    if (c == NULL) {
        fprintf(stderr, "txn_ender_consumer: %s\n", err.text);
        return 1;
    }
    static const char *const types[] = {"it.c_rollback",  "it.c_commit",      "it.c_rollback_begin",
                                        "it.exec_commit", "it.exec_rollback", "it.exec_async",
                                        "it.apply"};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (idem_consumer_register(c, types[i], on_event, NULL) != IDEM_OK) {
            fprintf(stderr, "txn_ender_consumer: cannot register %s\n", types[i]);
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
        fprintf(stderr, "txn_ender_consumer: %s\n", err.text);
        return 1;
    }
    return 0;
}
