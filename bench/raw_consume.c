/* raw_consume.c - the broker limit for the consumer: a bare librabbitmq consume-and-ack loop
 * (no database), and the small queue chores bench.py needs.
 *
 *   raw_consume --queue Q [--count N] [--prefetch 200] [--ack-every 100] [--idle-ms 5000]
 *       consumes from Q (which must exist) until N messages arrived (0: until none arrived for
 *       --idle-ms), acking with multiple=1 every --ack-every messages and at the end; prints one
 *       JSON line: msgs, seconds, rate (msgs/s from the consume-ok to the last ack).
 *   raw_consume --queue Q --declare   declares Q as a durable quorum queue (no binding)
 *   raw_consume --queue Q --purge     purges Q; prints {"purged": N} (-1: no such queue)
 *   raw_consume --queue Q --delete    deletes Q if it exists; prints {"deleted": N}
 *   raw_consume --queue Q --depth     prints {"messages": N, "consumers": N} (passive declare)
 *   --url URL (default $IDEM_AMQP_URL)
 *
 * Build: cc -O2 -o build/bench/raw_consume bench/raw_consume.c $(pkg-config --cflags --libs
 * librabbitmq) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/time.h>

#define RAW_TOOL "raw_consume"
#include "raw_common.h"

static void usage(void)
{
    fprintf(stderr,
            "usage: raw_consume [--url URL] --queue Q [--count N] [--prefetch N]\n"
            "                   [--ack-every N] [--idle-ms N]\n"
            "       raw_consume [--url URL] --queue Q --declare|--purge|--delete|--depth\n");
    exit(2);
}

static void ack(uint64_t tag)
{
    int rc = amqp_basic_ack(conn, CH, tag, 1);
    if (rc != AMQP_STATUS_OK)
        die("basic.ack", amqp_error_string2(rc));
}

int main(int argc, char **argv)
{
    const char *url = getenv("IDEM_AMQP_URL");
    const char *queue = NULL;
    const char *action = "consume";
    long count = 0, prefetch = 200, ack_every = 100, idle_ms = 5000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--declare") == 0 || strcmp(a, "--purge") == 0 ||
            strcmp(a, "--delete") == 0 || strcmp(a, "--depth") == 0) {
            action = a + 2;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            usage();
        if (strcmp(a, "--url") == 0)
            url = v;
        else if (strcmp(a, "--queue") == 0)
            queue = v;
        else if (strcmp(a, "--count") == 0)
            count = atol(v);
        else if (strcmp(a, "--prefetch") == 0)
            prefetch = atol(v);
        else if (strcmp(a, "--ack-every") == 0)
            ack_every = atol(v);
        else if (strcmp(a, "--idle-ms") == 0)
            idle_ms = atol(v);
        else
            usage();
        i++;
    }
    if (queue == NULL || prefetch < 1 || prefetch > 65535 || ack_every < 1 || count < 0)
        usage();
    if (url == NULL || *url == '\0')
        url = "amqp://guest:guest@127.0.0.1:5672";

    raw_connect(url);

    if (strcmp(action, "declare") == 0) {
        amqp_table_entry_t e[1];
        e[0].key = amqp_cstring_bytes("x-queue-type");
        e[0].value.kind = AMQP_FIELD_KIND_UTF8;
        e[0].value.value.bytes = amqp_cstring_bytes("quorum");
        amqp_table_t args = {1, e};
        amqp_queue_declare(conn, CH, amqp_cstring_bytes(queue), 0, 1, 0, 0, args);
        check_reply_404("queue.declare", 0);
        printf("{\"declared\":\"%s\"}\n", queue);
    } else if (strcmp(action, "purge") == 0) {
        amqp_queue_purge_ok_t *ok = amqp_queue_purge(conn, CH, amqp_cstring_bytes(queue));
        if (check_reply_404("queue.purge", 1) == 404) {
            printf("{\"purged\":-1}\n");
            amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
            amqp_destroy_connection(conn);
            return 0;
        }
        uint32_t n = ok->message_count; /* copy: points into the connection's pool */
        printf("{\"purged\":%u}\n", n);
    } else if (strcmp(action, "delete") == 0) {
        amqp_queue_delete_ok_t *ok = amqp_queue_delete(conn, CH, amqp_cstring_bytes(queue), 0, 0);
        if (check_reply_404("queue.delete", 1) == 404) {
            printf("{\"deleted\":0}\n");
            amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
            amqp_destroy_connection(conn);
            return 0;
        }
        uint32_t n = ok->message_count;
        printf("{\"deleted\":%u}\n", n);
    } else if (strcmp(action, "depth") == 0) {
        amqp_queue_declare_ok_t *ok =
            amqp_queue_declare(conn, CH, amqp_cstring_bytes(queue), 1, 0, 0, 0, amqp_empty_table);
        if (check_reply_404("queue.declare(passive)", 1) == 404) {
            printf("{\"messages\":-1,\"consumers\":0}\n");
            amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
            amqp_destroy_connection(conn);
            return 0;
        }
        uint32_t m = ok->message_count, c = ok->consumer_count;
        printf("{\"messages\":%u,\"consumers\":%u}\n", m, c);
    } else {
        amqp_basic_qos(conn, CH, 0, (uint16_t)prefetch, 0);
        check_reply_404("basic.qos", 0);
        amqp_basic_consume(conn, CH, amqp_cstring_bytes(queue), amqp_empty_bytes, 0, 0, 0,
                           amqp_empty_table);
        check_reply_404("basic.consume", 0);
        double t_start = now_s(), t_last = t_start;
        long got = 0, unacked = 0;
        uint64_t last_tag = 0;
        for (;;) {
            if (count > 0 && got >= count)
                break;
            amqp_envelope_t env;
            amqp_maybe_release_buffers(conn);
            struct timeval wt = {idle_ms / 1000, (idle_ms % 1000) * 1000};
            amqp_rpc_reply_t r = amqp_consume_message(conn, &env, &wt, 0);
            if (r.reply_type == AMQP_RESPONSE_NORMAL) {
                got++;
                unacked++;
                last_tag = env.delivery_tag;
                amqp_destroy_envelope(&env);
                if (unacked >= ack_every) {
                    ack(last_tag);
                    unacked = 0;
                }
                t_last = now_s();
                continue;
            }
            if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
                r.library_error == AMQP_STATUS_TIMEOUT) {
                if (count > 0) {
                    fprintf(stderr, "raw_consume: only %ld of %ld messages within %ld ms idle\n",
                            got, count, idle_ms);
                    return 1;
                }
                break;
            }
            if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
                r.library_error == AMQP_STATUS_UNEXPECTED_STATE) {
                amqp_frame_t f;
                if (amqp_simple_wait_frame(conn, &f) != AMQP_STATUS_OK)
                    die("consume", "lost the connection");
                if (f.frame_type == AMQP_FRAME_METHOD &&
                    (f.payload.method.id == AMQP_CHANNEL_CLOSE_METHOD ||
                     f.payload.method.id == AMQP_CONNECTION_CLOSE_METHOD))
                    die("consume", "the broker closed the channel");
                continue;
            }
            die("consume", r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION
                               ? amqp_error_string2(r.library_error)
                               : "server exception");
        }
        if (unacked > 0) {
            ack(last_tag);
            t_last = now_s();
        }
        double secs = t_last - t_start;
        printf("{\"tool\":\"raw_consume\",\"msgs\":%ld,\"seconds\":%.4f,\"rate\":%.1f,"
               "\"prefetch\":%ld,\"ack_every\":%ld}\n",
               got, secs, secs > 0 ? (double)got / secs : 0.0, prefetch, ack_every);
    }
    fflush(stdout);
    amqp_channel_close(conn, CH, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn);

    return 0;
}
