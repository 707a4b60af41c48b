/* metrics_http.h - the small HTTP server behind /metrics (metrics_http.c). */
#ifndef IDEM_METRICS_HTTP_H
#define IDEM_METRICS_HTTP_H

#include <stddef.h>
#include <stdio.h>

#include <idem/error.h>

typedef struct idemp_http idemp_http_t;
typedef void (*idemp_http_render_fn)(void *ud, FILE *out);
/* Writes /healthz's body (one line) to buf and returns its HTTP status (200 or 503). */
typedef int (*idemp_http_health_fn)(void *ud, char *buf, size_t sz);

/* Serves GET/HEAD /metrics and /healthz on listen_fd (a listening socket, owned from here on)
 * from a thread of its own; render writes /metrics' body, health answers /healthz. NULL with
 * err set on failure. */
idemp_http_t *idemp_http_start(int listen_fd, idemp_http_render_fn render,
                               idemp_http_health_fn health, void *ud, idem_error_t *err);
/* Stops the thread and closes every socket. NULL is a no-op. */
void idemp_http_stop(idemp_http_t *h);

#endif
