/* metrics_http.h - the small HTTP server behind /metrics and the console (metrics_http.c). */
#ifndef IDEM_METRICS_HTTP_H
#define IDEM_METRICS_HTTP_H

#include <stdbool.h>
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
/* ---- an application's requests (the console) ---- */

#define IDEMP_HTTP_BODY_MAX 8192 /* a longer request body is answered 413 */

typedef struct idemp_http_req {
    const char *method, *path; /* path without the query */
    const char *query;         /* after '?' (not decoded), "" when none */
    const char *head;          /* the whole request head, for idemp_http_header */
    const char *body;          /* NUL-terminated */
    size_t body_len;
} idemp_http_req_t;

typedef struct idemp_http_resp {
    int status;          /* 200 when left alone */
    const char *ctype;   /* "application/json" when NULL */
    char *body;          /* malloc'd, taken over by the server; NULL = empty */
    size_t len;          /* bytes of body */
    const char *headers; /* more header lines, each ending in \r\n (borrowed, may be NULL) */
} idemp_http_resp_t;

/* Called once per complete request (head and Content-Length body). */
typedef void (*idemp_http_handler_fn)(void *ud, const idemp_http_req_t *req,
                                      idemp_http_resp_t *resp);

/* Is req answered at once, touching no server (a static file)? Then fn runs on the server's own
 * thread; else on one of its worker threads (a few at once). */
typedef bool (*idemp_http_quick_fn)(void *ud, const idemp_http_req_t *req);

/* Serves every method and path through fn, with the same bounds as /metrics (connections,
 * read and write deadlines) and request bodies up to IDEMP_HTTP_BODY_MAX. fn runs on the
 * server's worker threads (several requests at once: it must be thread-safe), or, for the
 * requests quick (NULL: none) says are quick, on the server's thread. */
idemp_http_t *idemp_http_start_handler(int listen_fd, idemp_http_handler_fn fn,
                                       idemp_http_quick_fn quick, void *ud, idem_error_t *err);
/* The value of header name (case-insensitive) in req, without surrounding blanks, copied into
 * buf; false when absent or longer than sz - 1. */
bool idemp_http_header(const idemp_http_req_t *req, const char *name, char *buf, size_t sz);
/* A listening TCP socket on addr (a numeric IP address; NULL or "" = 127.0.0.1) and port, or -1
 * with err set ("cannot serve WHAT on port ..."), the kernel's reason included. */
int idemp_http_listen(const char *addr, int port, const char *what, idem_error_t *err);

/* Stops the thread and closes every socket. NULL is a no-op. */
void idemp_http_stop(idemp_http_t *h);

#endif
