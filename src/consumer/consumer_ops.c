/* consumer_ops.c - the consumer as operators see it: its health (/healthz, idem_consumer_up and
 * systemd's STATUS=), readiness and stopping told to systemd, a reload (SIGHUP), and noticing a
 * PostgreSQL server that went away while the consumer had nothing to do. */
#include <stdio.h>
#include <string.h>

#include <idem/log.h>

#include "clock.h"
#include "consumer_int.h"
#include "notify.h"

#define WATCH_EVERY_MS 1000

static const char *const LOGC = "consumer";

void idemp_consumer_watch_pg(idem_consumer_t *c)
{
    int64_t now = idemp_now_ms();
    if (now < c->watch_next_ms)
        return;
    c->watch_next_ms = now + WATCH_EVERY_MS;
    /* a connection with no COMMIT on its way is idle: what its socket has is a server's goodbye
     * (a shutdown, a terminated backend) or nothing; reading it drops a dead connection */
    for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
        if (c->commits[i] == NULL && idemp_pg_connected(c->pgs[i]))
            idemp_pg_take_notifies(c->pgs[i]);
}

void idemp_consumer_report(idem_consumer_t *c)
{
    bool pg_up = false;
    if (c->pg != NULL)
        pg_up = idemp_pg_connected(c->pg);
    else
        for (int i = 0; i < IDEMP_CONSUMER_CONNS; i++)
            pg_up = pg_up || idemp_pg_connected(c->pgs[i]);
    bool amqp_up = idemp_amqp_connected(c->in) && idemp_amqp_connected(c->out);
    idemp_metrics_health(c->metrics, pg_up, amqp_up, c->pause_cause);
    if (!c->cfg.sd_notify)
        return;
    char line[64], status[96];
    int code = idemp_health_line(pg_up, amqp_up, c->pause_cause, line, sizeof line);
    line[strcspn(line, "\n")] = '\0';
    if (code == 200)
        snprintf(status, sizeof status, "consuming %d queue%s", c->nqueues,
                 c->nqueues == 1 ? "" : "s");
    else
        snprintf(status, sizeof status, "%s", line);
    idemp_notify_status(&c->ready, c->told, sizeof c->told, code == 200 && c->sql_checked, status);
}

void idemp_consumer_stopping_told(idem_consumer_t *c)
{
    if (c->cfg.sd_notify)
        idemp_notify("STOPPING=1\nSTATUS=stopping");
}

void idemp_consumer_reload(idem_consumer_t *c)
{
    *c->cfg.reload = 0;
    if (c->cfg.sd_notify)
        idemp_notify("RELOADING=1");
    idemp_amqp_t *const conns[] = {c->in, c->out};
    const char *pw_state =
        idemp_amqp_reload_password(conns, 2, c->cfg.reload_password, c->cfg.reload_userdata, LOGC);
    /* the log is stderr: whoever holds its other end (journald, a shell's redirection) reopens */
    const char *kv[] = {"consumer", c->consumer, "password_file", pw_state, NULL};
    idem_log(IDEM_LOG_INFO, LOGC, kv, "reloaded");
    if (c->cfg.sd_notify)
        idemp_notify(c->ready ? "READY=1" : "STATUS=reloaded, not ready yet");
}
