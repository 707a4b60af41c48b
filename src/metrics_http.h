/* metrics_http.h - the small HTTP server behind /metrics (metrics_http.c). */
#ifndef IDEM_METRICS_HTTP_H
#define IDEM_METRICS_HTTP_H

#include <stdio.h>

#include <idem/error.h>

typedef struct idemp_http idemp_http_t;
typedef void (*idemp_http_render_fn)(void *ud, FILE *out);

/* Serves GET/HEAD /metrics on listen_fd (a listening socket, owned from here on) from a thread
 * of its own; render writes the body. NULL with err set on failure. */
idemp_http_t *idemp_http_start(int listen_fd, idemp_http_render_fn render, void *ud,
                               idem_error_t *err);
/* Stops the thread and closes every socket. NULL is a no-op. */
void idemp_http_stop(idemp_http_t *h);

#endif
