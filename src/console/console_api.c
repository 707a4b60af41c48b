/* console_api.c - the console's HTTP answers: the embedded page, and the JSON API over the same
 * library functions as the CLI (idem_status_query, idem_failed_list, idem_replay, idem_dlq_*),
 * so the CLI's rules hold here too (replay refuses stale rows, requeue confirms before it acks).
 *
 * Everything it returns is JSON built with jansson or a static file; every answer carries a
 * strict Content-Security-Policy and nosniff. Reads need no token; actions are POSTs with a JSON
 * body and "Authorization: Bearer TOKEN" (401 without, 403 with a wrong one, 403 when the console
 * has no token). On a loopback address the Host header must name it (no DNS rebinding). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <jansson.h>

#include <idem/log.h>
#include <idem/ops.h>
#include <idem/uuid.h>

#include "console_int.h"
#include "pg.h"

#define SECURITY_HEADERS                                                                           \
    "Content-Security-Policy: default-src 'self'; base-uri 'none'; form-action 'none'; "           \
    "frame-ancestors 'none'\r\n"                                                                   \
    "X-Content-Type-Options: nosniff\r\n"                                                          \
    "X-Frame-Options: DENY\r\n"                                                                    \
    "Referrer-Policy: no-referrer\r\n"                                                             \
    "Cache-Control: no-store\r\n"
#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))
#define DLQ_LIMIT 100

/* Answers with doc (stolen). */
static void reply(idemp_http_resp_t *resp, int status, json_t *doc)
{
    resp->status = status;
    resp->ctype = "application/json";
    resp->headers = SECURITY_HEADERS;
    resp->body = doc ? json_dumps(doc, JSON_FLAGS) : NULL;
    resp->len = resp->body ? strlen(resp->body) : 0;
    json_decref(doc);
    if (resp->body == NULL)
        resp->status = 500;
}

static void reply_error(idemp_http_resp_t *resp, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reply_error(idemp_http_resp_t *resp, int status, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    reply(resp, status, json_pack("{s:s}", "error", text));
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

/* The percent-decoded value of name in query into out; false when absent, too long or bad. */
static bool query_param(const char *query, const char *name, char *out, size_t sz)
{
    size_t nl = strlen(name);
    for (const char *p = query; p != NULL && *p; p = strchr(p, '&') ? strchr(p, '&') + 1 : NULL) {
        if (strncmp(p, name, nl) != 0 || p[nl] != '=')
            continue;
        size_t k = 0;
        for (const char *v = p + nl + 1; *v && *v != '&'; v++) {
            int ch = *v == '+' ? ' ' : (unsigned char)*v;
            if (*v == '%') {
                int hi = hexval(v[1]), lo = hi >= 0 ? hexval(v[2]) : -1;
                if (lo < 0)
                    return false;
                ch = hi * 16 + lo;
                v += 2;
            }
            if (ch == 0 || k + 1 >= sz)
                return false;
            out[k++] = (char)ch;
        }
        out[k] = '\0';
        return true;
    }
    return false;
}

/* The configured queue named name (borrowed from the configuration), or NULL. */
static const char *known_queue(const idemp_console_t *c, const char *name)
{
    for (int i = 0; name != NULL && i < c->cfg->nqueues; i++)
        if (strcmp(c->cfg->queues[i], name) == 0)
            return c->cfg->queues[i];
    return NULL;
}

static bool same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char diff = 0;
    for (size_t i = 0; i < lb; i++) /* as long for every guess of the same length */
        diff |= (unsigned char)((i < la ? a[i] : 0) ^ b[i]);
    return diff == 0 && la == lb;
}

/* May this request act? If not, the answer is set. */
static bool allowed(const idemp_console_t *c, const idemp_http_req_t *req, idemp_http_resp_t *resp)
{
    char auth[512], ctype[128];
    if (c->cfg->token == NULL) {
        reply_error(resp, 403, "the console is read-only (started without --token-file)");
        return false;
    }
    if (!idemp_http_header(req, "Authorization", auth, sizeof auth) ||
        strncasecmp(auth, "Bearer ", 7) != 0) {
        reply_error(resp, 401, "an action needs the header Authorization: Bearer TOKEN");
        resp->headers = SECURITY_HEADERS "WWW-Authenticate: Bearer realm=\"idem console\"\r\n";
        return false;
    }
    if (!same_secret(auth + 7, c->cfg->token)) {
        reply_error(resp, 403, "wrong token");
        return false;
    }
    if (!idemp_http_header(req, "Content-Type", ctype, sizeof ctype) ||
        strncasecmp(ctype, "application/json", 16) != 0) {
        reply_error(resp, 415, "the body must be application/json");
        return false;
    }
    return true;
}

/* On a loopback address, a page from another name that resolves to it (DNS rebinding) must not
 * read the API: Host must be the address itself or localhost. */
static bool host_ok(const idemp_console_t *c, const idemp_http_req_t *req)
{
    if (!c->loopback)
        return true;
    char host[300], want[3][80];
    if (!idemp_http_header(req, "Host", host, sizeof host))
        return false;
    const char *addr =
        c->cfg->listen_addr && c->cfg->listen_addr[0] ? c->cfg->listen_addr : "127.0.0.1";
    bool v6 = strchr(addr, ':') != NULL;
    snprintf(want[0], sizeof want[0], v6 ? "[%s]:%d" : "%s:%d", addr, c->cfg->port);
    snprintf(want[1], sizeof want[1], "localhost:%d", c->cfg->port);
    snprintf(want[2], sizeof want[2], v6 ? "[%s]" : "%s", addr);
    for (int i = 0; i < (c->cfg->port == 80 ? 3 : 2); i++)
        if (strcasecmp(host, want[i]) == 0)
            return true;
    return false;
}

static const char *ctype_of(const char *path)
{
    const char *dot = strrchr(path, '.');
    if (dot != NULL && strcmp(dot, ".js") == 0)
        return "text/javascript; charset=utf-8";
    if (dot != NULL && strcmp(dot, ".css") == 0)
        return "text/css; charset=utf-8";
    if (dot != NULL && strcmp(dot, ".svg") == 0)
        return "image/svg+xml";
    return "text/html; charset=utf-8";
}

static bool serve_asset(const char *path, idemp_http_resp_t *resp)
{
    if (strcmp(path, "/") == 0)
        path = "/index.html";
    for (const idemp_console_asset_t *a = idemp_console_assets; a->path != NULL; a++) {
        if (strcmp(a->path, path) != 0)
            continue;
        resp->body = malloc(a->len ? a->len : 1);
        if (resp->body == NULL) {
            resp->status = 500;
            return true;
        }
        memcpy(resp->body, a->data, a->len);
        resp->len = a->len;
        resp->ctype = ctype_of(path);
        resp->headers = SECURITY_HEADERS;
        return true;
    }
    return false;
}

/* ---- reads ---- */

typedef int (*pg_read_fn)(PGconn *conn, json_t **out, idem_error_t *err);

static void pg_read(const idemp_console_t *c, pg_read_fn fn, idemp_http_resp_t *resp)
{
    idem_error_t err = {0};
    json_t *doc = NULL;
    PGconn *conn = idemp_pg_connect_once(c->cfg->pg_conninfo, &err);
    int rc = conn ? fn(conn, &doc, &err) : err.code;
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK)
        reply_error(resp, 503, "%s", err.text[0] ? err.text : idem_strerror(rc));
    else
        reply(resp, 200, doc);
}

static void dlq_config(const idemp_console_t *c, const char *queue, idem_dlq_config_t *dc)
{
    idem_dlq_config_init(dc);
    dc->amqp_url = c->cfg->amqp_url;
    dc->amqp_password = c->cfg->amqp_password;
    dc->queue = queue;
    dc->limit = DLQ_LIMIT;
}

static void get_config(const idemp_console_t *c, idemp_http_resp_t *resp)
{
    json_t *qs = json_array();
    for (int i = 0; qs != NULL && i < c->cfg->nqueues; i++)
        json_array_append_new(qs, json_string(c->cfg->queues[i]));
    reply(resp, 200,
          json_pack("{s:o, s:b, s:f, s:f}", "queues", qs ? qs : json_array(), "actions",
                    c->cfg->token != NULL, "max_age_seconds", (double)c->cfg->max_age_ms / 1000.0,
                    "sample_seconds", (double)c->cfg->sample_ms / 1000.0));
}

static void get_history(idemp_console_t *c, idemp_http_resp_t *resp)
{
    pthread_mutex_lock(&c->mu);
    resp->body = strdup(c->history ? c->history : "[]");
    pthread_mutex_unlock(&c->mu);
    resp->len = resp->body ? strlen(resp->body) : 0;
    resp->status = resp->body ? 200 : 500;
    resp->ctype = "application/json";
    resp->headers = SECURITY_HEADERS;
}

static void get_dlq(const idemp_console_t *c, const idemp_http_req_t *req, bool one,
                    idemp_http_resp_t *resp)
{
    char name[256], id[64], canon[37];
    const char *queue =
        query_param(req->query, "queue", name, sizeof name) ? known_queue(c, name) : NULL;
    if (queue == NULL) {
        reply_error(resp, 404, "not one of the console's --queue");
        return;
    }
    idem_dlq_config_t dc;
    dlq_config(c, queue, &dc);
    if (one) {
        if (!query_param(req->query, "event_id", id, sizeof id) ||
            !idem_uuid_normalize(id, canon)) {
            reply_error(resp, 400, "event_id must be a UUID");
            return;
        }
        dc.event_id = canon;
    }
    idem_error_t err = {0};
    json_t *doc = NULL;
    int rc = one ? idem_dlq_show(&dc, &doc, &err) : idem_dlq_list(&dc, &doc, &err);
    if (rc == IDEM_ERR_NOT_FOUND)
        reply_error(resp, 404, "%s", err.text);
    else if (rc != IDEM_OK)
        reply_error(resp, 503, "%s", err.text[0] ? err.text : idem_strerror(rc));
    else
        reply(resp, 200, doc);
}

/* ---- actions ---- */

/* The body's "event_id" (canonical, into canon) and "queue" (one of the console's, or NULL when
 * queue is NULL). False with the answer set when they are not right. */
static bool action_args(const idemp_console_t *c, const idemp_http_req_t *req, char canon[37],
                        const char **queue, idemp_http_resp_t *resp)
{
    json_error_t jerr;
    json_t *body = json_loadb(req->body, req->body_len, JSON_REJECT_DUPLICATES, &jerr);
    const char *id = json_string_value(json_object_get(body, "event_id"));
    bool ok = id != NULL && idem_uuid_normalize(id, canon);
    if (!ok)
        reply_error(resp, 400, "the body must be a JSON object with \"event_id\": a UUID");
    if (ok && queue != NULL) {
        char name[256];
        const char *q = json_string_value(json_object_get(body, "queue"));
        if (q == NULL && query_param(req->query, "queue", name, sizeof name))
            q = name;
        *queue = known_queue(c, q);
        if (*queue == NULL) {
            reply_error(resp, 404, "\"queue\" is not one of the console's --queue");
            ok = false;
        }
    }
    json_decref(body);
    return ok;
}

static void post_replay(const idemp_console_t *c, const idemp_http_req_t *req,
                        idemp_http_resp_t *resp)
{
    char id[37];
    if (!action_args(c, req, id, NULL, resp))
        return;
    idem_error_t err = {0};
    int n = 0;
    PGconn *conn = idemp_pg_connect_once(c->cfg->pg_conninfo, &err);
    int rc = conn ? idem_replay(conn, id, c->cfg->dedup_window_ms, &n, &err) : err.code;
    idemp_pgconn_close(conn);
    const char *kv[] = {"event_id", id, "result", rc == IDEM_OK ? "replayed" : err.text, NULL};
    idem_log(rc == IDEM_OK ? IDEM_LOG_INFO : IDEM_LOG_WARN, "console", kv, "replay");
    if (rc == IDEM_OK)
        reply(resp, 200, json_pack("{s:i}", "replayed", n));
    else
        reply_error(resp,
                    rc == IDEM_ERR_REFUSED     ? 409
                    : rc == IDEM_ERR_NOT_FOUND ? 404
                                               : 503,
                    "%s", err.text[0] ? err.text : idem_strerror(rc));
}

static void post_dlq(const idemp_console_t *c, const idemp_http_req_t *req, bool requeue,
                     idemp_http_resp_t *resp)
{
    char id[37];
    const char *queue = NULL;
    if (!action_args(c, req, id, &queue, resp))
        return;
    idem_dlq_config_t dc;
    dlq_config(c, queue, &dc);
    dc.event_id = id;
    idem_error_t err = {0};
    int n = 0;
    int rc = requeue ? idem_dlq_requeue(&dc, &n, &err) : idem_dlq_discard(&dc, &n, &err);
    const char *what = requeue ? "requeued" : "discarded";
    char count[16];
    snprintf(count, sizeof count, "%d", n);
    const char *kv[] = {"event_id", id,    "queue", queue,
                        what,       count, "error", rc == IDEM_OK ? NULL : err.text,
                        NULL};
    idem_log(rc == IDEM_OK ? IDEM_LOG_INFO : IDEM_LOG_WARN, "console", kv, "dlq %s",
             requeue ? "requeue" : "discard");
    if (rc == IDEM_OK)
        reply(resp, 200, json_pack("{s:i}", what, n));
    else
        reply(
            resp, rc == IDEM_ERR_NOT_FOUND ? 404 : 503,
            json_pack("{s:s, s:i}", "error", err.text[0] ? err.text : idem_strerror(rc), what, n));
}

bool idemp_console_quick(void *ud, const idemp_http_req_t *req)
{
    (void)ud;
    const char *p = req->path;
    /* everything under /api/ but these two asks PostgreSQL or RabbitMQ */
    return strncmp(p, "/api/", 5) != 0 || strcmp(p, "/api/config") == 0 ||
           strcmp(p, "/api/history") == 0;
}

void idemp_console_handle(void *ud, const idemp_http_req_t *req, idemp_http_resp_t *resp)
{
    idemp_console_t *c = ud;
    bool get = strcmp(req->method, "GET") == 0 || strcmp(req->method, "HEAD") == 0;
    bool post = strcmp(req->method, "POST") == 0;
    const char *p = req->path;
    bool action = strcmp(p, "/api/replay") == 0 || strcmp(p, "/api/dlq/requeue") == 0 ||
                  strcmp(p, "/api/dlq/discard") == 0;
    if (!host_ok(c, req))
        reply_error(resp, 403, "the Host header does not name this console");
    else if (action && post) {
        if (!allowed(c, req, resp))
            return;
        if (strcmp(p, "/api/replay") == 0)
            post_replay(c, req, resp);
        else
            post_dlq(c, req, strcmp(p, "/api/dlq/requeue") == 0, resp);
    } else if (!get || action) {
        reply_error(resp, 405, "%s is not served here", req->method);
        resp->headers = SECURITY_HEADERS "Allow: GET, HEAD, POST\r\n";
    } else if (strcmp(p, "/api/status") == 0)
        pg_read(c, idem_status_query, resp);
    else if (strcmp(p, "/api/failed") == 0)
        pg_read(c, idem_failed_list, resp);
    else if (strcmp(p, "/api/history") == 0)
        get_history(c, resp);
    else if (strcmp(p, "/api/config") == 0)
        get_config(c, resp);
    else if (strcmp(p, "/api/dlq") == 0)
        get_dlq(c, req, false, resp);
    else if (strcmp(p, "/api/dlq/message") == 0)
        get_dlq(c, req, true, resp);
    else if (!serve_asset(p, resp))
        reply_error(resp, 404, "not found");
}
