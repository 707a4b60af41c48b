/* console_int.h - what the console's files (console.c, console_api.c, the generated
 * console_assets.c) share. Not for other modules. */
#ifndef IDEM_CONSOLE_INT_H
#define IDEM_CONSOLE_INT_H

#include <pthread.h>
#include <stddef.h>

#include <idem/console.h>

#include "metrics_http.h"

/* The page's files, embedded by make from src/console/assets/ (path "/index.html", ...); the
 * table ends with a NULL path. */
typedef struct idemp_console_asset {
    const char *path;
    size_t len;
    const unsigned char *data;
} idemp_console_asset_t;
extern const idemp_console_asset_t idemp_console_assets[];

typedef struct idemp_console {
    const idem_console_config_t *cfg;
    bool loopback; /* listening on a loopback address: the Host header must name it */
    pthread_mutex_t mu;
    char *history; /* JSON text of the backlog samples (under mu; NULL before the first) */
    bool failing;  /* the last sample failed (the sampler's thread only) */
} idemp_console_t;

/* The HTTP handler of the page and the API (console_api.c); runs on the server's worker
 * threads, several at once, or for what idemp_console_quick says is quick (the page's files,
 * /api/config, /api/history: nothing that asks a server) on the server's own thread. */
void idemp_console_handle(void *ud, const idemp_http_req_t *req, idemp_http_resp_t *resp);
bool idemp_console_quick(void *ud, const idemp_http_req_t *req);

#endif
