/* dlq.c - the dead-letter queue of a consumer: list or show what is in QUEUE.dlq without taking
 * it, discard chosen messages for good, and move chosen messages back to the consumer's queue (each
 * publish confirmed before its DLQ copy is acked, so a crash in between leaves a copy in both
 * places, never in neither; the ledger absorbs the extra one). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/ops.h>

#include "clock.h"
#include "envelope.h"
#include "mask.h"
#include "rmq.h"
#include "uuid.h"

#define BODY_MAX (512LL << 20) /* larger than any message RabbitMQ accepts */
#define CONFIRM_TIMEOUT_MS 30000

static char *dlq_name(const char *queue)
{
    size_t n = strlen(queue) + 5;
    char *s = malloc(n);
    if (s != NULL)
        snprintf(s, n, "%s.dlq", queue);
    return s;
}

/* A JSON string of bytes a hostile publisher chose: not UTF-8 (or holding NUL) becomes \xNN. */
static json_t *text(const char *p, size_t len)
{
    json_t *v = memchr(p, '\0', len) == NULL ? json_stringn(p, len) : NULL;
    if (v != NULL)
        return v;
    char raw[1024], esc[4096];
    size_t n = len < sizeof raw - 1 ? len : sizeof raw - 1;
    for (size_t i = 0; i < n; i++)
        raw[i] = p[i] == '\0' ? '\x01' : p[i];
    raw[n] = '\0';
    idemp_log_escape(raw, esc, sizeof esc, false);
    return json_string(esc);
}

static json_t *strn_or_null(idemp_str_t s)
{
    return s.ptr != NULL ? text(s.ptr, s.len) : json_null();
}

/* One DLQ message as a JSON object: event_id, event_type, code, detail, age_seconds, requeued. */
static json_t *describe(const idemp_msg_t *m, int64_t now_ms)
{
    idemp_envelope_in_t in;
    idemp_msg_envelope_in(m, &in);
    idemp_str_t id = in.message_id.ptr ? in.message_id : in.hdr_event_id;
    idemp_str_t type = in.type.ptr ? in.type : in.hdr_event_type;
    size_t elen = 0;
    const char *e = idemp_msg_header(m, "x-idem-error", &elen);
    const char *colon = e ? memchr(e, ':', elen) : NULL;
    json_t *o = json_object();
    if (o == NULL)
        return NULL;
    json_object_set_new(o, "event_id", strn_or_null(id));
    json_object_set_new(o, "event_type", strn_or_null(type));
    if (colon != NULL) {
        const char *d = colon + 1;
        while (d < e + elen && *d == ' ')
            d++;
        json_object_set_new(o, "code", text(e, (size_t)(colon - e)));
        json_object_set_new(o, "detail", text(d, (size_t)(e + elen - d)));
    } else {
        json_object_set_new(o, "code", e ? text(e, elen) : json_null());
        json_object_set_new(o, "detail", json_null());
    }
    uint64_t ts;
    int64_t secs;
    if (idemp_msg_timestamp(m, &ts) && idemp_envelope_timestamp(ts, now_ms, &secs))
        json_object_set_new(o, "age_seconds", json_integer(now_ms / 1000 - secs));
    else
        json_object_set_new(o, "age_seconds", json_null());
    int64_t moves = 0;
    idemp_msg_header_int(m, "x-idem-requeued", &moves);
    json_object_set_new(o, "requeued", json_integer(moves));
    return o;
}

static idemp_amqp_t *connect_to(const idem_dlq_config_t *cfg, bool confirms, idem_error_t *err)
{
    idemp_amqp_t *a = idemp_amqp_new(cfg->amqp_url, "dlq", cfg->heartbeat_s, err);
    if (a == NULL)
        return NULL;
    if ((cfg->amqp_password != NULL && idemp_amqp_set_password(a, cfg->amqp_password) != 0) ||
        idemp_amqp_connect(a, confirms, err) != IDEM_OK) {
        if (err != NULL && err->code == 0)
            idem_error_set(err, IDEM_ERR_INVALID, "the AMQP password is too long");
        idemp_amqp_free(a);
        return NULL;
    }
    return a;
}

void idem_dlq_config_init(idem_dlq_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->limit = 100;
    cfg->heartbeat_s = 0;
}

int idem_dlq_list(const idem_dlq_config_t *cfg, json_t **out, idem_error_t *err)
{
    *out = NULL;
    char *dlq = dlq_name(cfg->queue);
    json_t *list = json_array();
    if (dlq == NULL || list == NULL) {
        free(dlq);
        json_decref(list);
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    idemp_amqp_t *a = connect_to(cfg, false, err);
    int rc = a ? IDEM_OK : err->code;
    uint32_t depth = 0;
    if (rc == IDEM_OK)
        rc = idemp_amqp_queue_depth(a, dlq, &depth, err);
    int64_t now = idemp_wall_ms();
    /* nothing is acked: closing the channel gives every message back, in its place */
    for (int i = 0; rc == IDEM_OK && i < cfg->limit && (uint32_t)i < depth; i++) {
        idemp_msg_t *m = NULL;
        rc = idemp_amqp_get(a, dlq, BODY_MAX, &m, err);
        if (rc == IDEM_ERR_NOT_FOUND) {
            rc = IDEM_OK;
            break;
        }
        if (rc == IDEM_OK) {
            json_t *o = describe(m, now);
            if (o == NULL || json_array_append_new(list, o) != 0)
                rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        }
        idemp_msg_free(m);
    }
    if (a != NULL)
        idemp_amqp_disconnect(a, NULL);
    idemp_amqp_free(a);
    free(dlq);
    if (rc != IDEM_OK) {
        json_decref(list);
        return rc;
    }
    *out = list;
    return IDEM_OK;
}

/* Does m match the selection? */
static bool selected(const idem_dlq_config_t *cfg, const idemp_msg_t *m)
{
    if (cfg->code != NULL) {
        size_t elen = 0, cl = strlen(cfg->code);
        const char *e = idemp_msg_header(m, "x-idem-error", &elen);
        if (e == NULL || elen <= cl || memcmp(e, cfg->code, cl) != 0 || e[cl] != ':')
            return false;
    }
    if (cfg->event_id == NULL)
        return true;
    idemp_envelope_in_t in;
    idemp_msg_envelope_in(m, &in);
    idemp_str_t id = in.message_id.ptr ? in.message_id : in.hdr_event_id;
    char a[37], b[37];
    return id.ptr != NULL && idemp_uuid_normalize(id.ptr, id.len, a) &&
           idemp_uuid_normalize(cfg->event_id, strlen(cfg->event_id), b) && strcmp(a, b) == 0;
}

/* Where a requeued message goes: the consumer's queue through the default exchange, or a
 * partitioned group's QUEUE.part (*key NULL: each message with its subscription's shard key,
 * see shard_key). */
static int target(idemp_amqp_t *a, const char *queue, char **exchange, const char **key,
                  idem_error_t *err)
{
    uint32_t depth;
    idem_error_t e = {0};
    int rc = idemp_amqp_queue_depth(a, queue, &depth, &e);
    if (rc == IDEM_OK) {
        *exchange = strdup("");
        *key = queue;
        return *exchange ? IDEM_OK : idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    }
    if (rc != IDEM_ERR_NOT_FOUND) {
        *err = e;
        return rc;
    }
    size_t n = strlen(queue) + 6;
    *exchange = malloc(n);
    if (*exchange == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    snprintf(*exchange, n, "%s.part", queue);
    *key = NULL;
    rc = idemp_amqp_declare_exchange(a, *exchange, "direct", NULL, true, &e);
    if (rc == IDEM_ERR_NOT_FOUND)
        return idem_error_set(err, rc, "neither queue %s nor exchange %s exists", queue, *exchange);
    if (rc != IDEM_OK)
        *err = e;
    return rc;
}

/* The shard key of m's subscription_id header (the relay's BCC is gone from a delivered
 * message), or "" without one: QUEUE.part then sends it to QUEUE.p0, like a foreign message. */
static void shard_key(const idemp_msg_t *m, char *out, size_t n)
{
    size_t len = 0;
    const char *s = idemp_msg_header(m, "subscription_id", &len);
    char id[37];
    int shard = s != NULL && idemp_uuid_normalize(s, len, id) ? idemp_amqp_shard(id) : -1;
    if (shard >= 0)
        snprintf(out, n, "idem.shard.%d", shard);
    else
        out[0] = '\0';
}

/* What is done with a selected message before its DLQ copy is acked (NULL: nothing, i.e. it is
 * discarded). */
typedef int (*dlq_action_fn)(void *ud, const idemp_msg_t *m, idem_error_t *err);

/* Takes each selected message of dlq once, applies fn, then acks it: a failure or a crash before
 * the ack leaves it in the DLQ. What is not selected is held unacked until the connection closes,
 * which gives it back in its place. *count counts the acked ones. */
static int take_selected(const idem_dlq_config_t *cfg, idemp_amqp_t *in, const char *dlq,
                         dlq_action_fn fn, void *ud, int *count, idem_error_t *err)
{
    uint32_t depth = 0;
    int rc = idemp_amqp_queue_depth(in, dlq, &depth, err);
    for (uint32_t i = 0; rc == IDEM_OK && i < depth; i++) {
        idemp_msg_t *m = NULL;
        rc = idemp_amqp_get(in, dlq, BODY_MAX, &m, err);
        if (rc == IDEM_ERR_NOT_FOUND) {
            rc = IDEM_OK;
            break;
        }
        if (rc == IDEM_OK && selected(cfg, m)) {
            rc = fn != NULL ? fn(ud, m, err) : IDEM_OK;
            if (rc == IDEM_OK)
                rc = idemp_amqp_ack(in, idemp_msg_tag(m), false, err);
            if (rc == IDEM_OK)
                (*count)++;
        }
        idemp_msg_free(m);
    }
    return rc;
}

typedef struct requeue_target {
    idemp_amqp_t *out;
    char *exchange;
    const char *key; /* NULL: each message's shard key */
} requeue_target_t;

static int requeue_one(void *ud, const idemp_msg_t *m, idem_error_t *err)
{
    requeue_target_t *t = ud;
    char shard[24];
    if (t->key == NULL)
        shard_key(m, shard, sizeof shard);
    return idemp_amqp_requeue(t->out, m, t->exchange, t->key ? t->key : shard, CONFIRM_TIMEOUT_MS,
                              err);
}

int idem_dlq_requeue(const idem_dlq_config_t *cfg, int *moved, idem_error_t *err)
{
    *moved = 0;
    char *dlq = dlq_name(cfg->queue);
    if (dlq == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    requeue_target_t t = {0};
    idemp_amqp_t *in = connect_to(cfg, false, err);
    t.out = in ? connect_to(cfg, true, err) : NULL;
    int rc = t.out ? IDEM_OK : err->code;
    if (rc == IDEM_OK)
        rc = target(t.out, cfg->queue, &t.exchange, &t.key, err);
    if (rc == IDEM_OK)
        rc = take_selected(cfg, in, dlq, requeue_one, &t, moved, err);
    if (in != NULL)
        idemp_amqp_disconnect(in, NULL); /* gives back what was not moved */
    if (t.out != NULL)
        idemp_amqp_disconnect(t.out, NULL);
    idemp_amqp_free(in);
    idemp_amqp_free(t.out);
    free(t.exchange);
    free(dlq);
    return rc;
}

int idem_dlq_discard(const idem_dlq_config_t *cfg, int *discarded, idem_error_t *err)
{
    *discarded = 0;
    char *dlq = dlq_name(cfg->queue);
    if (dlq == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    idemp_amqp_t *in = connect_to(cfg, false, err);
    int rc = in ? take_selected(cfg, in, dlq, NULL, NULL, discarded, err) : err->code;
    if (in != NULL)
        idemp_amqp_disconnect(in, NULL); /* gives back what was not selected */
    idemp_amqp_free(in);
    free(dlq);
    return rc;
}

int idem_dlq_show(const idem_dlq_config_t *cfg, json_t **out, idem_error_t *err)
{
    *out = NULL;
    if (cfg->event_id == NULL)
        return idem_error_set(err, IDEM_ERR_INVALID, "dlq show needs an event id");
    char *dlq = dlq_name(cfg->queue);
    if (dlq == NULL)
        return idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    idemp_amqp_t *a = connect_to(cfg, false, err);
    int rc = a ? IDEM_OK : err->code;
    uint32_t depth = 0;
    if (rc == IDEM_OK)
        rc = idemp_amqp_queue_depth(a, dlq, &depth, err);
    json_t *found = NULL;
    int64_t now = idemp_wall_ms();
    /* nothing is acked: closing the channel gives every message back, in its place */
    for (uint32_t i = 0; rc == IDEM_OK && found == NULL && i < depth; i++) {
        idemp_msg_t *m = NULL;
        rc = idemp_amqp_get(a, dlq, BODY_MAX, &m, err);
        if (rc == IDEM_ERR_NOT_FOUND) {
            rc = IDEM_OK;
            break;
        }
        if (rc == IDEM_OK && selected(cfg, m)) {
            found = describe(m, now);
            json_t *more = idemp_msg_describe(m);
            if (found == NULL || more == NULL || json_object_update(found, more) != 0)
                rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
            json_decref(more);
        }
        idemp_msg_free(m);
    }
    if (a != NULL)
        idemp_amqp_disconnect(a, NULL);
    idemp_amqp_free(a);
    if (rc == IDEM_OK && found == NULL)
        rc = idem_error_set(err, IDEM_ERR_NOT_FOUND, "event %s is not in %s", cfg->event_id, dlq);
    free(dlq);
    if (rc != IDEM_OK) {
        json_decref(found);
        return rc;
    }
    *out = found;
    return IDEM_OK;
}
