/* rmq_topology.c - declaring (or, passively, checking) exchanges and queues, bindings, qos and
 * consume on the adapter's channel. */
#include <string.h>

#include "rmq_int.h"

/* ---- topology ----------------------------------------------------------------------------- */

static amqp_table_entry_t str_entry(const char *key, const char *val)
{
    amqp_table_entry_t e;
    e.key = amqp_cstring_bytes(key);
    e.value.kind = AMQP_FIELD_KIND_UTF8;
    e.value.value.bytes = amqp_cstring_bytes(val);
    return e;
}

/* A passive declare of something missing closes the channel with 404: that is an answer, not a
 * failure of the connection, which is reopened. */
static int passive_result(idemp_amqp_t *a, int rc, const char *name, idem_error_t *err,
                          idem_error_t *e)
{
    if (rc == IDEM_OK)
        return IDEM_OK;
    if (rc == IDEM_ERR_AMQP && a->close_code == AMQP_NOT_FOUND) {
        return idem_error_set(err, IDEM_ERR_NOT_FOUND, "%s does not exist on RabbitMQ at %s", name,
                              a->where);
    }
    if (err != NULL && err->code == 0)
        *err = *e;
    return rc;
}

/* After a 404 (or a 406) the channel is closed but the connection lives: open the channel
 * again. */
static int reopen_channel(idemp_amqp_t *a, idem_error_t *err)
{
    if (a->conn == NULL ||
        (a->close_code != AMQP_NOT_FOUND && a->close_code != AMQP_PRECONDITION_FAILED))
        return IDEM_ERR_AMQP;
    a->connected = true;
    amqp_channel_open(a->conn, IDEMP_CHANNEL);
    int rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "channel.open", err);
    if (rc == IDEM_OK && a->confirms) {
        amqp_confirm_select(a->conn, IDEMP_CHANNEL);
        rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "confirm.select", err);
        a->next_tag = 1;
        a->confirmed = 0;
    }
    return rc;
}

/* The reply of a declare of name: a passive one that finds nothing reopens the channel the
 * broker closed and reports IDEM_ERR_NOT_FOUND (see passive_result). */
static int declared(idemp_amqp_t *a, const char *method, const char *name, bool passive,
                    idem_error_t *err)
{
    idem_error_t ee = {0};
    char what[300];
    snprintf(what, sizeof what, "%s %s", method, name);
    int rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), what, &ee);
    if (rc != IDEM_OK && passive && a->close_code == AMQP_NOT_FOUND) {
        int rc2 = reopen_channel(a, err);
        return rc2 == IDEM_OK ? passive_result(a, rc, name, err, &ee) : rc2;
    }
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = ee;
    return rc;
}

int idemp_amqp_declare_exchange(idemp_amqp_t *a, const char *name, const char *type,
                                const char *alternate, bool passive, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_table_entry_t e[1];
    amqp_table_t args = {0, e};
    if (alternate != NULL && !passive)
        e[args.num_entries++] = str_entry("alternate-exchange", alternate);
    amqp_exchange_declare(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(name),
                          amqp_cstring_bytes(type), passive, 1, 0, 0, args);
    return declared(a, "exchange.declare", name, passive, err);
}

int idemp_amqp_declare_queue(idemp_amqp_t *a, const char *name, const idemp_queue_spec_t *spec,
                             bool passive, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_table_entry_t e[4];
    amqp_table_t args = {0, e};
    if (!passive && spec != NULL) {
        if (spec->quorum)
            e[args.num_entries++] = str_entry("x-queue-type", "quorum");
        if (spec->dlx != NULL)
            e[args.num_entries++] = str_entry("x-dead-letter-exchange", spec->dlx);
        if (spec->dlk != NULL)
            e[args.num_entries++] = str_entry("x-dead-letter-routing-key", spec->dlk);
        if (spec->single_active) {
            e[args.num_entries].key = amqp_cstring_bytes("x-single-active-consumer");
            e[args.num_entries].value.kind = AMQP_FIELD_KIND_BOOLEAN;
            e[args.num_entries].value.value.boolean = 1;
            args.num_entries++;
        }
    }
    amqp_queue_declare(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(name), passive, 1, 0, 0, args);
    return declared(a, "queue.declare", name, passive, err);
}

int idemp_amqp_delete_unused_exchange(idemp_amqp_t *a, const char *name, bool *in_use,
                                      idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    *in_use = false;
    amqp_exchange_delete(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(name), 1);
    idem_error_t ee = {0};
    int rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "exchange.delete", &ee);
    if (rc != IDEM_OK && a->close_code == AMQP_PRECONDITION_FAILED) {
        *in_use = true;
        return reopen_channel(a, err);
    }
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = ee;
    return rc;
}

int idemp_amqp_bind(idemp_amqp_t *a, const char *queue, const char *exchange, const char *key,
                    idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_queue_bind(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(queue), amqp_cstring_bytes(exchange),
                    amqp_cstring_bytes(key), amqp_empty_table);
    return idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "queue.bind", err);
}

int idemp_amqp_bind_nowait(idemp_amqp_t *a, const char *queue, const char *exchange,
                           const char *key, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_queue_bind_t req = {.ticket = 0,
                             .queue = amqp_cstring_bytes(queue),
                             .exchange = amqp_cstring_bytes(exchange),
                             .routing_key = amqp_cstring_bytes(key),
                             .nowait = 1,
                             .arguments = amqp_empty_table};
    int st = amqp_send_method(a->conn, IDEMP_CHANNEL, AMQP_QUEUE_BIND_METHOD, &req);
    if (st != AMQP_STATUS_OK) {
        idem_error_set(err, IDEM_ERR_AMQP_LOST, "queue.bind to RabbitMQ at %s: %s", a->where,
                       amqp_error_string2(st));
        idemp_amqp_disconnect(a, "queue.bind could not be sent");
        return IDEM_ERR_AMQP_LOST;
    }
    return IDEM_OK;
}

int idemp_amqp_bind_exchange(idemp_amqp_t *a, const char *dest, const char *source, const char *key,
                             idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_exchange_bind(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(dest), amqp_cstring_bytes(source),
                       amqp_cstring_bytes(key), amqp_empty_table);
    return idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "exchange.bind", err);
}

int idemp_amqp_qos(idemp_amqp_t *a, int prefetch, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_basic_qos(a->conn, IDEMP_CHANNEL, 0, (uint16_t)prefetch, 0);
    return idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "basic.qos", err);
}

int idemp_amqp_consume(idemp_amqp_t *a, const char *queue, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    /* the consumer tag is the queue's name: a delivery says which queue it came from */
    amqp_basic_consume(a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(queue), amqp_cstring_bytes(queue),
                       0, 0, 0, amqp_empty_table);
    return idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "basic.consume", err);
}

int idemp_amqp_queue_depth(idemp_amqp_t *a, const char *queue, uint32_t *messages,
                           idem_error_t *err)
{
    uint32_t consumers;
    return idemp_amqp_queue_info(a, queue, messages, &consumers, err);
}

int idemp_amqp_queue_info(idemp_amqp_t *a, const char *queue, uint32_t *messages,
                          uint32_t *consumers, idem_error_t *err)
{
    if (!a->connected)
        return idem_error_set(err, IDEM_ERR_AMQP_LOST, "not connected to RabbitMQ at %s", a->where);
    amqp_queue_declare_ok_t *ok = amqp_queue_declare(
        a->conn, IDEMP_CHANNEL, amqp_cstring_bytes(queue), 1, 1, 0, 0, amqp_empty_table);
    if (ok != NULL) {
        *messages = ok->message_count; /* copied before the next call reuses the pool */
        *consumers = ok->consumer_count;
        return IDEM_OK;
    }
    idem_error_t ee = {0};
    int rc = idemp_amqp_check_rpc(a, amqp_get_rpc_reply(a->conn), "queue.declare", &ee);
    if (a->close_code == AMQP_NOT_FOUND) {
        int rc2 = reopen_channel(a, err);
        return rc2 == IDEM_OK ? passive_result(a, rc, queue, err, &ee) : rc2;
    }
    if (err != NULL && err->code == 0)
        *err = ee;
    return rc;
}
