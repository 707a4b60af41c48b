/* refund_consumer.c - an exactly-once consumer with a handler of its own: each refund.issued
 * event credits its subscription's balance once, however often the broker delivers it.
 *
 *   cc refund_consumer.c $(pkg-config --cflags --libs idem) -o refund_consumer
 *   IDEM_PG_URL=... IDEM_AMQP_URL=... ./refund_consumer [QUEUE]
 *
 * QUEUE defaults to refunds.q; the consumer's name in the dedup ledger is "refunds". SIGTERM or
 * SIGINT: finish and commit the batch in hand, ack it, exit 0; a second signal exits at once. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idem/idem.h>

/* One statement, so the credit row and the balance commit with the claim of the event id. */
#define SQL_CREDIT_REFUND                                                                          \
    "WITH credit AS ("                                                                             \
    "  INSERT INTO refund_credits (refund_id, subscription_id, amount_cents, currency, event_id,"  \
    "                              traceparent)"                                                   \
    "  VALUES ($1, $2, $3, $4, $5, $6)) "                                                          \
    "INSERT INTO credit_balances (subscription_id, currency, balance_cents) VALUES ($2, $4, $3) "  \
    "ON CONFLICT (subscription_id, currency) DO UPDATE "                                           \
    "SET balance_cents = credit_balances.balance_cents + EXCLUDED.balance_cents"

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
    if (stop)
        _exit(1); /* the second signal: what was not acked is redelivered */
    stop = sig;
}

static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

/* payload: {"refund_id": uuid, "subscription_id": uuid, "amount_cents": integer > 0,
 *           "currency": 3 letters} */
static idem_outcome on_refund_issued(idem_event_t *ev, void *userdata)
{
    (void)userdata;
    json_t *p = idem_event_payload(ev); /* borrowed */
    const char *refund = json_string_value(json_object_get(p, "refund_id"));
    const char *sub = json_string_value(json_object_get(p, "subscription_id"));
    json_t *amount = json_object_get(p, "amount_cents");
    const char *currency = json_string_value(json_object_get(p, "currency"));
    char refund_id[37], sub_id[37], cents[24];
    if (refund == NULL || !idem_uuid_normalize(refund, refund_id))
        return idem_event_fail(ev, IDEM_INVALID, "refund_id: not a UUID");
    if (sub == NULL || !idem_uuid_normalize(sub, sub_id))
        return idem_event_fail(ev, IDEM_INVALID, "subscription_id: not a UUID");
    if (!json_is_integer(amount) || json_integer_value(amount) <= 0)
        return idem_event_fail(ev, IDEM_INVALID, "amount_cents: not an integer > 0");
    if (currency == NULL || strlen(currency) != 3)
        return idem_event_fail(ev, IDEM_INVALID, "currency: not 3 letters");
    snprintf(cents, sizeof cents, "%" JSON_INTEGER_FORMAT, json_integer_value(amount));

    /* the emitting request's trace context, carried as a message header (NULL when absent):
     * stored with the effect here; a real service would also start its span under it */
    const char *traceparent = idem_event_header(ev, "traceparent");

    const char *params[] = {refund_id, sub_id, cents, currency, idem_event_id(ev), traceparent};
    /* in the claim's transaction; a transient SQLSTATE comes back as IDEM_RETRY */
    return idem_event_exec(ev, SQL_CREDIT_REFUND, 6, params, NULL);
}

int main(int argc, char **argv)
{
    if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
        fprintf(stderr, "usage: %s [QUEUE]   (IDEM_PG_URL, IDEM_AMQP_URL, IDEM_EXCHANGE)\n",
                argv[0]);
        return 2;
    }
    idem_consumer_config_t cfg;
    idem_consumer_config_init(&cfg);
    cfg.consumer = "refunds";
    cfg.queue = argc == 2 ? argv[1] : "refunds.q";
    cfg.pg_conninfo = env("IDEM_PG_URL"); /* NULL: libpq's PG* defaults */
    cfg.amqp_url = env("IDEM_AMQP_URL");  /* NULL: amqp://guest:guest@127.0.0.1:5672 */
    cfg.exchange = env("IDEM_EXCHANGE");  /* NULL: billing.events */
    cfg.stop = &stop;                     /* the loop returns once the batch in hand is acked */

    idem_error_t err = {0};
    idem_consumer_t *c = idem_consumer_new(&cfg, &err);
    if (c == NULL) {
        fprintf(stderr, "refund_consumer: %s\n", err.text);
        return 1;
    }
    if (idem_consumer_register(c, "refund.issued", on_refund_issued, NULL) != IDEM_OK) {
        fprintf(stderr, "refund_consumer: cannot register the handler\n");
        idem_consumer_free(c);
        return 1;
    }

    /* Handlers only set the flag. No SA_RESTART, so a blocking wait returns at once. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN); /* a closed socket is an error to handle, not a reason to die */

    int rc = idem_consumer_run(c, &err); /* until stop is set; servers down are retried */
    idem_consumer_free(c);
    if (rc != IDEM_OK) {
        fprintf(stderr, "refund_consumer: %s\n", err.text);
        return 1;
    }
    return 0;
}
