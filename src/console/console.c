/* console.c - `idem console`: serves the operator's page and its API (console_api.c) from the
 * bounded HTTP server of metrics_http.c (a few requests at once), tells systemd when it listens,
 * and samples the backlog every few seconds for the page's sparklines (kept in memory, the last
 * HISTORY_MAX samples). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include <idem/log.h>
#include <idem/ops.h>

#include "clock.h"
#include "console_int.h"
#include "notify.h"
#include "pg.h"

#define HISTORY_MAX 120 /* 10 minutes at the default 5 s */
#define TYPES_MAX 32    /* event types kept per sample: the largest backlogs */

void idem_console_config_init(idem_console_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->pg_conninfo = "";
    cfg->listen_addr = "127.0.0.1";
    cfg->port = 8080;
    cfg->max_age_ms = 5 * 60 * 1000;
    cfg->dedup_window_ms = 30LL * 24 * 3600 * 1000;
    cfg->sample_ms = 5000;
}

/* One sample: {"t": unix seconds, "pending", "oldest", "types": {TYPE: [pending, oldest]}}. */
static json_t *sample_of(json_t *status)
{
    json_t *totals = json_object_get(status, "totals"), *types = json_object();
    json_t *s = json_pack("{s:I, s:O, s:O, s:o}", "t", (json_int_t)time(NULL), "pending",
                          json_object_get(totals, "pending"), "oldest",
                          json_object_get(totals, "oldest_pending_seconds"), "types", types);
    if (s == NULL)
        return NULL;
    size_t i;
    json_t *t;
    json_array_foreach(json_object_get(status, "event_types"), i, t)
    {
        if (i >= TYPES_MAX)
            break;
        const char *name = json_string_value(json_object_get(t, "event_type"));
        if (name != NULL)
            json_object_set_new(types, name,
                                json_pack("[O, O]", json_object_get(t, "pending"),
                                          json_object_get(t, "oldest_pending_seconds")));
    }
    return s;
}

/* Samples the backlog once (a new connection when the last one broke) into samples. */
static void sample(idemp_console_t *c, PGconn **conn, json_t *samples)
{
    idem_error_t err = {0};
    if (*conn == NULL)
        *conn = idemp_pg_connect_once(c->cfg->pg_conninfo, &err);
    json_t *status = NULL;
    if (*conn != NULL && idem_status_query(*conn, &status, &err) != IDEM_OK) {
        idemp_pgconn_close(*conn);
        *conn = NULL;
    }
    if (status == NULL) {
        if (!c->failing) /* once per outage, not every sample */
            idem_log(IDEM_LOG_WARN, "console", NULL, "cannot sample the backlog: %s", err.text);
        c->failing = true;
        return;
    }
    if (c->failing)
        idem_log(IDEM_LOG_INFO, "console", NULL, "sampling the backlog again");
    c->failing = false;
    json_t *s = sample_of(status);
    json_decref(status);
    if (s == NULL || json_array_append_new(samples, s) != 0)
        return;
    while (json_array_size(samples) > HISTORY_MAX)
        json_array_remove(samples, 0);
    char *text = json_dumps(samples, JSON_COMPACT | JSON_REAL_PRECISION(15));
    if (text == NULL)
        return;
    pthread_mutex_lock(&c->mu);
    free(c->history);
    c->history = text;
    pthread_mutex_unlock(&c->mu);
}

static bool is_loopback(const char *addr)
{
    return strncmp(addr, "127.", 4) == 0 || strcmp(addr, "::1") == 0;
}

int idem_console_run(const idem_console_config_t *cfg, idem_error_t *err)
{
    idemp_console_t c = {.cfg = cfg};
    const char *addr = cfg->listen_addr && cfg->listen_addr[0] ? cfg->listen_addr : "127.0.0.1";
    c.loopback = is_loopback(addr);
    int fd = idemp_http_listen(addr, cfg->port, "the console", err);
    if (fd < 0)
        return err != NULL ? err->code : IDEM_ERR_IO;
    pthread_mutex_init(&c.mu, NULL);
    idemp_http_t *h =
        idemp_http_start_handler(fd, idemp_console_handle, idemp_console_quick, &c, err);
    if (h == NULL) {
        pthread_mutex_destroy(&c.mu);
        return err != NULL ? err->code : IDEM_ERR_IO;
    }
    char port[8];
    snprintf(port, sizeof port, "%d", cfg->port);
    const char *kv[] = {"listen", addr,      "port",
                        port,     "actions", cfg->token ? "on" : "off (read-only: no --token-file)",
                        NULL};
    idem_log(IDEM_LOG_INFO, "console", kv, "serving the operator console");
    if (cfg->sd_notify) /* listening: a connection from now on is answered */
        idemp_notifyf("READY=1\nSTATUS=serving the operator console on %s port %s", addr, port);
    json_t *samples = json_array();
    PGconn *conn = NULL;
    int64_t next = 0;
    while (!*cfg->stop) {
        int64_t now = idemp_now_ms();
        if (now >= next && samples != NULL) {
            sample(&c, &conn, samples);
            next = now + (cfg->sample_ms > 0 ? cfg->sample_ms : 5000);
        }
        idemp_sleep_ms(100, cfg->stop);
    }
    if (cfg->sd_notify)
        idemp_notify("STOPPING=1");
    idemp_http_stop(h);
    idemp_pgconn_close(conn);
    json_decref(samples);
    free(c.history);
    pthread_mutex_destroy(&c.mu);
    idem_log(IDEM_LOG_INFO, "console", NULL, "stopped");
    return IDEM_OK;
}
