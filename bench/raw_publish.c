/* raw_publish.c - the broker limit for the relay: a bare librabbitmq publisher with publisher
 * confirms, doing what the relay does on the wire and nothing else (no database).
 *
 * Publishes --count persistent, mandatory messages to --exchange (a durable topic exchange,
 * declared idempotently) in windows of --window messages: publish a window, wait until every
 * message of it is confirmed, next window - the relay's batch cycle without the claim and the
 * mark-sent. Each message carries what the relay's carry: message_id, type, content_type,
 * timestamp, user_id (the login), headers event_id/subscription_id/event_type/x-idem-seq and the
 * shard key in BCC (idem.shard.N, one per subscription; RabbitMQ routes on it and removes it before
 * delivery), and a billing JSON body of about --body-bytes bytes, over --subscriptions
 * subscriptions. --wire v2 sends what the relay sent before the contract's v3: no user_id, no
 * x-idem-seq, no BCC (the bench runs both, to show what the broker spends on the additions). With
 * --queue, a durable quorum queue of that name is declared and bound to the exchange with the
 * routing key first (with an empty
 * --exchange the message goes through the default exchange straight to --routing-key).
 *
 * Prints one JSON line on stdout: msgs, seconds, rate (msgs/s, measured from the first confirmed
 * window to the last, the same estimator bench.py applies to the relay's commit timestamps),
 * wall_rate (msgs/s from the first publish), window, returned, nacked. Exit 1 on any failure,
 * including a return or a nack.
 *
 * Build: cc -O2 -o build/bench/raw_publish bench/raw_publish.c $(pkg-config --cflags --libs
 * librabbitmq) */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/time.h>

#define RAW_TOOL "raw_publish"
#include "raw_common.h"

static uint64_t rng_state;
static uint64_t rng(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}

static void uuid4(char out[37])
{
    uint8_t b[16];
    uint64_t x = rng(), y = rng();
    memcpy(b, &x, 8);
    memcpy(b + 8, &y, 8);
    b[6] = (uint8_t)((b[6] & 0x0f) | 0x40);
    b[8] = (uint8_t)((b[8] & 0x3f) | 0x80);
    static const char hex[] = "0123456789abcdef";
    int o = 0;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            out[o++] = '-';
        out[o++] = hex[b[i] >> 4];
        out[o++] = hex[b[i] & 15];
    }
    out[o] = '\0';
}

static void usage(void)
{
    fprintf(stderr,
            "usage: raw_publish [--url URL] [--exchange NAME] [--routing-key KEY] [--queue Q]\n"
            "                   [--count N] [--window N] [--subscriptions N] [--body-bytes N]\n"
            "                   [--type EVENT_TYPE] [--wire v2|v3]\n"
            "defaults: --url $IDEM_AMQP_URL, --exchange billing.events, --routing-key = --type,\n"
            "          --type payment.failed, --count 100000, --window 200, --subscriptions "
            "500,\n"
            "          --body-bytes 200, --wire v3\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *url = getenv("IDEM_AMQP_URL");
    const char *exchange = "billing.events";
    const char *rkey = NULL;
    const char *queue = NULL;
    const char *type = "payment.failed";
    long count = 100000, window = 200, nsubs = 500, body_bytes = 200;
    int wire = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            usage();
        if (strcmp(a, "--url") == 0)
            url = v;
        else if (strcmp(a, "--exchange") == 0)
            exchange = v;
        else if (strcmp(a, "--routing-key") == 0)
            rkey = v;
        else if (strcmp(a, "--queue") == 0)
            queue = v;
        else if (strcmp(a, "--type") == 0)
            type = v;
        else if (strcmp(a, "--count") == 0)
            count = atol(v);
        else if (strcmp(a, "--window") == 0)
            window = atol(v);
        else if (strcmp(a, "--subscriptions") == 0)
            nsubs = atol(v);
        else if (strcmp(a, "--body-bytes") == 0)
            body_bytes = atol(v);
        else if (strcmp(a, "--wire") == 0 && (strcmp(v, "v2") == 0 || strcmp(v, "v3") == 0))
            wire = v[1] - '0';
        else
            usage();
        i++;
    }
    if (rkey == NULL)
        rkey = type;
    if (url == NULL || *url == '\0')
        url = "amqp://guest:guest@127.0.0.1:5672";
    if (count < 0 || window < 1 || nsubs < 1 || body_bytes < 0 || body_bytes > 65536)
        usage();

    struct timeval tv0;
    gettimeofday(&tv0, NULL);
    rng_state = ((uint64_t)tv0.tv_sec * 1000003u) ^ (uint64_t)tv0.tv_usec ^
                ((uint64_t)getpid() << 32) ^ 0x9E3779B97F4A7C15ULL;

    raw_connect(url);
    amqp_confirm_select(conn, CH);
    check_reply_404("confirm.select", 0);
    if (*exchange != '\0') {
        amqp_exchange_declare(conn, CH, amqp_cstring_bytes(exchange), amqp_cstring_bytes("topic"),
                              0, 1, 0, 0, amqp_empty_table);
        check_reply_404("exchange.declare", 0);
    }
    if (queue != NULL) {
        amqp_table_entry_t e[1];
        e[0].key = amqp_cstring_bytes("x-queue-type");
        e[0].value.kind = AMQP_FIELD_KIND_UTF8;
        e[0].value.value.bytes = amqp_cstring_bytes("quorum");
        amqp_table_t args = {1, e};
        amqp_queue_declare(conn, CH, amqp_cstring_bytes(queue), 0, 1, 0, 0, args);
        check_reply_404("queue.declare", 0);
        if (*exchange != '\0') {
            amqp_queue_bind(conn, CH, amqp_cstring_bytes(queue), amqp_cstring_bytes(exchange),
                            amqp_cstring_bytes(rkey), amqp_empty_table);
            check_reply_404("queue.bind", 0);
        }
    }

    /* subscriptions: fixed per run */
    char(*subs)[37] = malloc((size_t)nsubs * 37);
    if (subs == NULL)
        die("malloc", NULL);
    for (long i = 0; i < nsubs; i++)
        uuid4(subs[i]);

    long published = 0, confirmed_msgs = 0, returned = 0, nacked = 0;
    uint64_t next_tag = 1; /* the next publish's confirm sequence number */
    uint8_t *done = malloc((size_t)window);
    if (done == NULL)
        die("malloc", NULL);
    double t_start = now_s(), t_first_window = 0, t_end = t_start;
    long first_window = 0;
    char body[65536 + 512];
    char event_id[37], invoice_id[37];

    while (published < count) {
        long n = count - published < window ? count - published : window;
        for (long k = 0; k < n; k++) {
            const char *sub = subs[(published + k) % nsubs];
            uuid4(event_id);
            uuid4(invoice_id);
            int len = snprintf(body, sizeof body,
                               "{\"invoice_id\":\"%s\",\"subscription_id\":\"%s\","
                               "\"amount_cents\":4999,\"currency\":\"EUR\","
                               "\"reason\":\"card_declined\",\"note\":\"",
                               invoice_id, sub);
            while (len < body_bytes - 2)
                body[len++] = 'x';
            body[len++] = '"';
            body[len++] = '}';
            body[len] = '\0';

            amqp_table_entry_t h[5];
            h[0].key = amqp_cstring_bytes("event_id");
            h[0].value.kind = AMQP_FIELD_KIND_UTF8;
            h[0].value.value.bytes = amqp_cstring_bytes(event_id);
            h[1].key = amqp_cstring_bytes("subscription_id");
            h[1].value.kind = AMQP_FIELD_KIND_UTF8;
            h[1].value.value.bytes = amqp_cstring_bytes(sub);
            h[2].key = amqp_cstring_bytes("event_type");
            h[2].value.kind = AMQP_FIELD_KIND_UTF8;
            h[2].value.value.bytes = amqp_cstring_bytes(type);
            char shard_key[24];
            amqp_field_value_t shard_val;
            if (wire == 3) {
                h[3].key = amqp_cstring_bytes("x-idem-seq");
                h[3].value.kind = AMQP_FIELD_KIND_I64;
                h[3].value.value.i64 = published + k + 1;
                snprintf(shard_key, sizeof shard_key, "idem.shard.%ld",
                         ((published + k) % nsubs) % 1024);
                shard_val.kind = AMQP_FIELD_KIND_UTF8;
                shard_val.value.bytes = amqp_cstring_bytes(shard_key);
                h[4].key = amqp_cstring_bytes("BCC");
                h[4].value.kind = AMQP_FIELD_KIND_ARRAY;
                h[4].value.value.array = (amqp_array_t){1, &shard_val};
            }
            amqp_basic_properties_t p;
            memset(&p, 0, sizeof p);
            p._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
                       AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TYPE_FLAG |
                       AMQP_BASIC_TIMESTAMP_FLAG | AMQP_BASIC_HEADERS_FLAG;
            p.content_type = amqp_cstring_bytes("application/json");
            p.delivery_mode = 2;
            p.message_id = amqp_cstring_bytes(event_id);
            p.type = amqp_cstring_bytes(type);
            p.timestamp = (uint64_t)time(NULL);
            p.headers.num_entries = wire == 3 ? 5 : 3;
            p.headers.entries = h;
            if (wire == 3) {
                p._flags |= AMQP_BASIC_USER_ID_FLAG;
                p.user_id = amqp_cstring_bytes(raw_user);
            }
            amqp_bytes_t b = {(size_t)len, body};
            int rc = amqp_basic_publish(conn, CH, amqp_cstring_bytes(exchange),
                                        amqp_cstring_bytes(rkey), 1, 0, &p, b);
            if (rc != AMQP_STATUS_OK)
                die("basic.publish", amqp_error_string2(rc));
            next_tag++;
        }
        published += n;
        /* settle every tag of the window; acks may be multiple and need not be in order */
        uint64_t base = next_tag - (uint64_t)n;
        memset(done, 0, (size_t)n);
        long left = n;
        while (left > 0) {
            amqp_frame_t f;
            struct timeval wt = {30, 0};
            int rc = amqp_simple_wait_frame_noblock(conn, &f, &wt);
            if (rc == AMQP_STATUS_TIMEOUT)
                die("confirms", "none within 30 s");
            if (rc != AMQP_STATUS_OK)
                die("confirms", amqp_error_string2(rc));
            if (f.frame_type != AMQP_FRAME_METHOD)
                continue;
            uint64_t tag = 0;
            int multiple = 0;
            switch (f.payload.method.id) {
            case AMQP_BASIC_ACK_METHOD: {
                amqp_basic_ack_t *m = f.payload.method.decoded;
                tag = m->delivery_tag;
                multiple = m->multiple;
                break;
            }
            case AMQP_BASIC_NACK_METHOD: {
                amqp_basic_nack_t *m = f.payload.method.decoded;
                tag = m->delivery_tag;
                multiple = m->multiple;
                nacked++;
                break;
            }
            case AMQP_BASIC_RETURN_METHOD: {
                amqp_message_t msg;
                amqp_rpc_reply_t r = amqp_read_message(conn, f.channel, &msg, 0);
                if (r.reply_type != AMQP_RESPONSE_NORMAL)
                    die("basic.return", "could not read the returned message");
                amqp_destroy_message(&msg);
                returned++;
                continue;
            }
            case AMQP_CHANNEL_CLOSE_METHOD:
            case AMQP_CONNECTION_CLOSE_METHOD:
                die("confirms", "the broker closed the channel");
                break;
            default:
                continue;
            }
            uint64_t lo = multiple ? base : tag;
            for (uint64_t t = lo < base ? base : lo; t <= tag && t < next_tag; t++)
                if (!done[t - base]) {
                    done[t - base] = 1;
                    left--;
                }
        }
        confirmed_msgs += n;
        t_end = now_s();
        if (first_window == 0) {
            first_window = n;
            t_first_window = t_end;
        }
        amqp_maybe_release_buffers(conn);
    }

    double secs = t_end - t_start;
    double span = t_end - t_first_window;
    double rate = (span > 0 && confirmed_msgs > first_window)
                      ? (double)(confirmed_msgs - first_window) / span
                      : (secs > 0 ? (double)confirmed_msgs / secs : 0.0);
    printf("{\"tool\":\"raw_publish\",\"msgs\":%ld,\"seconds\":%.4f,\"rate\":%.1f,"
           "\"wall_rate\":%.1f,\"window\":%ld,\"returned\":%ld,\"nacked\":%ld}\n",
           confirmed_msgs, secs, rate, secs > 0 ? (double)confirmed_msgs / secs : 0.0, window,
           returned, nacked);
    fflush(stdout);

    amqp_channel_close(conn, CH, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn);
    free(subs);
    free(done);

    return (returned || nacked) ? 1 : 0;
}
