/* idem/console.h - the operator console: a web page and its JSON API over the operations of
 * idem/ops.h (status, failed, replay, dlq list/show/requeue/discard), served on one address. */
#ifndef IDEM_CONSOLE_H
#define IDEM_CONSOLE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include <idem/error.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_console_config {
    const char *pg_conninfo;   /* "" = libpq's PG* defaults */
    const char *amqp_url;      /* one URL or a comma-separated list */
    const char *amqp_password; /* overrides the URL's when set */
    const char *listen_addr;   /* numeric IP address; default 127.0.0.1 */
    int port;                  /* default 8080 */
    const char *const *queues; /* the consumers' queues whose dead letters are shown (borrowed) */
    int nqueues;
    const char *token;           /* actions need "Authorization: Bearer TOKEN"; NULL = read-only */
    int64_t max_age_ms;          /* the page warns when the oldest pending row is older; 5m */
    int64_t dedup_window_ms;     /* replay refuses rows older than this; 30d */
    int64_t sample_ms;           /* the backlog is sampled this often for the sparklines; 5s */
    volatile sig_atomic_t *stop; /* required: the console runs until *stop is set */
    bool sd_notify; /* tell systemd ($NOTIFY_SOCKET) READY=1 once listening, STOPPING=1 */
} idem_console_config_t;

void idem_console_config_init(idem_console_config_t *cfg);

/* Listens (IDEM_ERR_IO with the kernel's reason when it cannot), serves until *cfg->stop, and
 * returns IDEM_OK. Every configuration pointer is borrowed for the whole run. */
int idem_console_run(const idem_console_config_t *cfg, idem_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
