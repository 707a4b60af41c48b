/* consumer_topology.c - what the consumer declares on RabbitMQ (or, with --no-declare, checks):
 * the exchange, the dead-letter exchange and queue, and QUEUE or a partitioned group's shard
 * exchange and partition queues, every queue with single active consumer; then qos and
 * consume. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer_int.h"

char *idemp_consumer_name(const char *fmt, const char *a, int i)
{
    size_t n = strlen(fmt) + strlen(a) + 16;
    char *s = malloc(n);
    if (s != NULL)
        snprintf(s, n, fmt, a, i);
    return s;
}

/* ---- topology ----------------------------------------------------------------------------- */

static int bind_keys(idem_consumer_t *c, const char *target, bool exchange, idem_error_t *err)
{
    int rc = IDEM_OK;
    size_t n = c->binds ? 0 : idemp_registry_count(c->reg);
    for (size_t i = 0; rc == IDEM_OK; i++) {
        const char *key = c->binds ? c->binds[i] : (i < n ? idemp_registry_type(c->reg, i) : NULL);
        if (key == NULL)
            break;
        rc = exchange ? idemp_amqp_bind_exchange(c->in, target, c->exchange, key, err)
                      : idemp_amqp_bind(c->in, target, c->exchange, key, err);
    }
    return rc;
}

/* Does queue exist? IDEM_OK (*yes set) or a failure of the connection. */
static int exists(idem_consumer_t *c, const char *queue, bool *yes, idem_error_t *err)
{
    idem_error_t e = {0};
    int rc = idemp_amqp_declare_queue(c->in, queue, NULL, true, &e);
    *yes = rc == IDEM_OK;
    if (rc == IDEM_OK || rc == IDEM_ERR_NOT_FOUND)
        return IDEM_OK;
    if (err != NULL && err->code == 0)
        *err = e;
    return rc;
}

static int mismatch(idem_consumer_t *c, const char *declared, idem_error_t *err)
{
    return idem_error_set(err, IDEM_ERR_REFUSED,
                          "%s is declared %s, this process has --partitions %d; every process of "
                          "a group must use the same --partitions (to change it: stop the relay, "
                          "drain, delete the old queues, start again; README \"Upgrading and "
                          "changing --partitions\")",
                          c->queue, declared, c->cfg.partitions);
}

/* P = 1: QUEUE must not be partitioned already (QUEUE.p0 would go on receiving events). */
static int check_not_partitioned(idem_consumer_t *c, idem_error_t *err)
{
    char *first = idemp_consumer_name("%s.p%d", c->queue, 0);
    bool yes = false;
    int rc = first ? exists(c, first, &yes, err) : IDEM_ERR_NOMEM;
    free(first);
    if (rc == IDEM_OK && yes)
        rc = mismatch(c, "as a partitioned group (QUEUE.p0, ...)", err);
    return rc;
}

/* P > 1: the partitions must be exactly p0..p<P-1>: p<P> must not exist, nor p0 without p<P-1>
 * (declare_partitions declares p0 last). */
static int check_partition_count(idem_consumer_t *c, idem_error_t *err)
{
    int p = c->cfg.partitions;
    char *beyond = idemp_consumer_name("%s.p%d", c->queue, p),
         *last = idemp_consumer_name("%s.p%d", c->queue, p - 1);
    char *first = idemp_consumer_name("%s.p%d", c->queue, 0);
    int rc = beyond && last && first ? IDEM_OK : IDEM_ERR_NOMEM;
    bool single = false;
    if (rc == IDEM_OK)
        rc = exists(c, c->queue, &single, err);
    if (rc == IDEM_OK && single)
        rc = mismatch(c, "as a single queue (--partitions 1)", err);
    if (rc != IDEM_OK) {
        free(beyond);
        free(last);
        free(first);
        return rc;
    }
    idem_error_t e = {0};
    int more = rc == IDEM_OK ? idemp_amqp_declare_queue(c->in, beyond, NULL, true, &e) : rc;
    int has_first = more == IDEM_ERR_NOT_FOUND || more == IDEM_OK
                        ? idemp_amqp_declare_queue(c->in, first, NULL, true, &e)
                        : more;
    int has_last = has_first == IDEM_OK ? idemp_amqp_declare_queue(c->in, last, NULL, true, &e)
                                        : IDEM_ERR_NOT_FOUND;
    if (more == IDEM_OK || (has_first == IDEM_OK && has_last == IDEM_ERR_NOT_FOUND))
        rc = idem_error_set(err, IDEM_ERR_REFUSED,
                            "%s is already partitioned %s %d queues (%s.p0, ...); every process "
                            "of a group must use the same --partitions (to change it: README "
                            "\"Upgrading and changing --partitions\")",
                            c->queue, more == IDEM_OK ? "into more than" : "into fewer than", p,
                            c->queue);
    else if (more != IDEM_ERR_NOT_FOUND && more != IDEM_OK)
        rc = more;
    else if (has_first != IDEM_OK && has_first != IDEM_ERR_NOT_FOUND)
        rc = has_first;
    else if (has_last != IDEM_OK && has_last != IDEM_ERR_NOT_FOUND)
        rc = has_last;
    if (rc != IDEM_OK && err != NULL && err->code == 0)
        *err = e;
    free(beyond);
    free(last);
    free(first);
    return rc;
}

/* A declare that RabbitMQ refused with PRECONDITION_FAILED: what exists has other arguments
 * (an older idem declared QUEUE without single active consumer, or another tool declared it). */
static int inequivalent(const char *name, idem_error_t *err)
{
    char said[sizeof err->text];
    memcpy(said, err != NULL ? err->text : "", err != NULL ? sizeof said : 1);
    if (err != NULL)
        err->code = 0;
    return idem_error_set(err, IDEM_ERR_REFUSED,
                          "%s exists with other arguments than this idem declares (a quorum queue "
                          "with x-single-active-consumer; an older idem declared it without): "
                          "stop the relay, let the old consumers drain it, stop them, delete it "
                          "and start again (README \"Upgrading and changing --partitions\"); "
                          "RabbitMQ said: %.200s",
                          name, said);
}

static int declare_queue(idem_consumer_t *c, const char *name, const idemp_queue_spec_t *spec,
                         idem_error_t *err)
{
    int rc = idemp_amqp_declare_queue(c->in, name, spec, false, err);
    if (rc != IDEM_OK && idemp_amqp_close_code(c->in) == 406)
        rc = inequivalent(name, err);
    return rc;
}

/* An older idem partitioned a group through the consistent-hash exchange QUEUE.hash. While its
 * partitions are bound to it the group must not be used: it is to be drained and its queues
 * deleted first. Once they are, QUEUE.hash routes nowhere and is deleted here (if_unused: never
 * while anything is bound to it); with --no-declare it must be gone. */
static int check_no_ring(idem_consumer_t *c, bool may_delete, idem_error_t *err)
{
    char *hash = idemp_consumer_name("%s.hash", c->queue, 0);
    if (hash == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    idem_error_t e = {0};
    bool in_use = true;
    int rc = idemp_amqp_declare_exchange(c->in, hash, "x-consistent-hash", NULL, true, &e);
    if (rc == IDEM_ERR_NOT_FOUND) {
        rc = IDEM_OK;
        in_use = false;
    } else if (rc == IDEM_OK && may_delete) {
        rc = idemp_amqp_delete_unused_exchange(c->in, hash, &in_use, err);
        if (rc == IDEM_OK && !in_use)
            idemp_consumer_log(IDEM_LOG_INFO, c, NULL,
                               "deleted %s, the unused hash exchange of an older idem", hash);
    } else if (rc != IDEM_OK && err != NULL && err->code == 0) {
        *err = e;
    }
    if (rc == IDEM_OK && in_use)
        rc = idem_error_set(err, IDEM_ERR_REFUSED,
                            "%s exists%s: %s was partitioned by an older idem through a hash "
                            "ring; stop the relay, let the old consumers drain the group, stop "
                            "them, delete the queues %s.p0, ... and start again (README "
                            "\"Upgrading and changing --partitions\")",
                            hash, may_delete ? " with queues bound to it" : "", c->queue, c->queue);
    free(hash);
    return rc;
}

/* Partition i's binding keys on QUEUE.part: idem.shard.N for every shard N with N mod P = i. */
static int bind_shards(idem_consumer_t *c, const char *queue, int i, idem_error_t *err)
{
    /* one round trip, not one per key (up to 1,024 of them at every connect): every bind but the
     * last goes without waiting, and the last one's answer tells whether the channel survived */
    int rc = IDEM_OK;
    for (int n = i; rc == IDEM_OK && n < IDEMP_SHARDS; n += c->cfg.partitions) {
        char key[24];
        snprintf(key, sizeof key, "idem.shard.%d", n);
        bool last = n + c->cfg.partitions >= IDEMP_SHARDS;
        rc = last ? idemp_amqp_bind(c->in, queue, c->part_exchange, key, err)
                  : idemp_amqp_bind_nowait(c->in, queue, c->part_exchange, key, err);
    }
    return rc;
}

/* QUEUE.part (direct) routes by the relay's shard key (BCC) to exactly one partition; a message
 * without one matches no binding there and goes, through QUEUE.part's alternate exchange
 * QUEUE.part.unkeyed (fanout), to QUEUE.p0. Nothing here depends on broker state that changes on
 * its own: a restart moves nothing. QUEUE.part is bound to the main exchange last, once every
 * shard has its partition (a shard not bound yet would reach p0 through the alternate exchange). */
static int declare_partitions(idem_consumer_t *c, const idemp_queue_spec_t *spec, idem_error_t *err)
{
    int rc = check_no_ring(c, true, err);
    if (rc == IDEM_OK)
        rc = check_partition_count(c, err);
    if (rc == IDEM_OK)
        rc = idemp_amqp_declare_exchange(c->in, c->unkeyed_exchange, "fanout", NULL, false, err);
    if (rc == IDEM_OK)
        rc = idemp_amqp_declare_exchange(c->in, c->part_exchange, "direct", c->unkeyed_exchange,
                                         false, err);
    /* from the last partition to the first: whoever finds p0 finds all of them (processes of a
     * group starting together must not mistake a half-declared group for a smaller one) */
    for (int i = c->cfg.partitions - 1; rc == IDEM_OK && i >= 0; i--) {
        char *name = idemp_consumer_name("%s.p%d", c->queue, i);
        rc = name ? declare_queue(c, name, spec, err)
                  : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        if (rc == IDEM_OK)
            rc = bind_shards(c, name, i, err);
        if (rc == IDEM_OK && i == 0)
            rc = idemp_amqp_bind(c->in, name, c->unkeyed_exchange, "", err);
        free(name);
    }
    if (rc == IDEM_OK)
        rc = bind_keys(c, c->part_exchange, true, err);
    return rc;
}

/* QUEUE.dlq: a quorum queue, so that losing one node of a cluster does not take it away; one
 * that exists already (of any type) is kept as it is. */
static int declare_dlq(idem_consumer_t *c, idem_error_t *err)
{
    bool yes = false;
    int rc = exists(c, c->dlq, &yes, err);
    if (rc != IDEM_OK || yes)
        return rc;
    idemp_queue_spec_t dlq = {true, false, NULL, NULL};
    return idemp_amqp_declare_queue(c->in, c->dlq, &dlq, false, err);
}

/* With --no-declare: everything used must exist already, and no older topology be in the way
 * (the queues' arguments cannot be checked without the configure permission: the operator who
 * declares them gives them single active consumer, see the README). */
static int check_topology(idem_consumer_t *c, idem_error_t *err)
{
    int rc = idemp_amqp_declare_exchange(c->in, c->exchange, "topic", NULL, true, err);
    if (rc == IDEM_OK)
        rc = idemp_amqp_declare_exchange(c->in, c->dlx, "direct", NULL, true, err);
    if (rc == IDEM_OK)
        rc = idemp_amqp_declare_queue(c->in, c->dlq, NULL, true, err);
    if (rc == IDEM_OK && c->cfg.partitions == 1)
        rc = check_not_partitioned(c, err);
    if (rc == IDEM_OK && c->cfg.partitions > 1)
        rc = check_no_ring(c, false, err);
    if (rc == IDEM_OK && c->cfg.partitions > 1)
        rc = check_partition_count(c, err);
    if (rc == IDEM_OK && c->cfg.partitions > 1)
        rc = idemp_amqp_declare_exchange(c->in, c->part_exchange, "direct", NULL, true, err);
    for (int i = 0; rc == IDEM_OK && i < c->nqueues; i++)
        rc = idemp_amqp_declare_queue(c->in, c->queues[i], NULL, true, err);
    return rc;
}

int idemp_consumer_topology(idem_consumer_t *c, idem_error_t *err)
{
    int rc;
    if (c->cfg.no_declare) {
        rc = check_topology(c, err);
    } else {
        idemp_queue_spec_t main = {true, true, c->dlx, c->dlq};
        rc = idemp_amqp_declare_exchange(c->in, c->exchange, "topic", NULL, false, err);
        if (rc == IDEM_OK)
            rc = idemp_amqp_declare_exchange(c->in, c->dlx, "direct", NULL, false, err);
        if (rc == IDEM_OK)
            rc = declare_dlq(c, err);
        if (rc == IDEM_OK)
            rc = idemp_amqp_bind(c->in, c->dlq, c->dlx, c->dlq, err);
        if (rc == IDEM_OK && c->cfg.partitions == 1)
            rc = check_not_partitioned(c, err);
        if (rc == IDEM_OK && c->cfg.partitions == 1) {
            rc = declare_queue(c, c->queue, &main, err);
            if (rc == IDEM_OK)
                rc = bind_keys(c, c->queue, false, err);
        } else if (rc == IDEM_OK) {
            rc = declare_partitions(c, &main, err);
        }
    }
    if (rc == IDEM_OK)
        rc = idemp_amqp_qos(c->in, c->cfg.prefetch, err);
    for (int i = 0; rc == IDEM_OK && i < c->nqueues; i++)
        rc = idemp_amqp_consume(c->in, c->queues[i], err);
    return rc;
}
