/* metrics_http.c - the /metrics endpoint: a small HTTP/1.x server on its own thread.
 *
 * It answers GET and HEAD /metrics and /healthz (404 for other paths, 405 for other methods;
 * /healthz is 200 or 503 with one line, see idemp_metrics_healthz) and closes each connection after
 * its answer. It holds at most HTTP_CONNS connections: when a new one arrives and all are taken,
 * the oldest that has not finished sending its request is closed, so connections that open and send
 * nothing (or dribble) can never keep a scrape out; a request must arrive within HTTP_READ_MS. One
 * poll loop, no allocation per byte. */
#define _GNU_SOURCE /* accept4, pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "metrics_http.h"

#define HTTP_CONNS 64
#define HTTP_READ_MS 2000
#define HTTP_WRITE_MS 5000
#define HTTP_REQ_MAX 4096

typedef struct conn {
    int fd; /* -1 when free */
    int64_t since;
    char in[HTTP_REQ_MAX];
    size_t inlen;
    char *out; /* the whole response, written as the socket takes it */
    size_t outlen, outoff;
} conn_t;

struct idemp_http {
    int listen_fd;
    int wake[2]; /* a pipe: stop */
    idemp_http_render_fn render;
    idemp_http_health_fn health;
    void *ud;
    pthread_t thread;
    atomic_bool stop;
    conn_t conns[HTTP_CONNS];
};

static void conn_close(conn_t *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->out);
    c->fd = -1;
    c->out = NULL;
    c->inlen = c->outlen = c->outoff = 0;
}

/* status and its reason phrase go on the status line; the body is text (one line), or with text
 * NULL, the rendered metrics. */
static void respond(idemp_http_t *h, conn_t *c, int status, const char *reason, const char *text,
                    bool head, const char *ctype)
{
    char *body = NULL;
    size_t blen = 0;
    if (text == NULL) {
        FILE *f = open_memstream(&body, &blen);
        if (f == NULL) {
            conn_close(c);
            return;
        }
        h->render(h->ud, f);
        fclose(f);
    } else {
        body = strdup(text);
        blen = body ? strlen(body) : 0;
    }
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n%s\r\n",
                     status, reason, ctype, blen, status == 405 ? "Allow: GET, HEAD\r\n" : "");
    size_t total = (size_t)n + (head ? 0 : blen);
    c->out = malloc(total);
    if (c->out == NULL || body == NULL) {
        free(body);
        conn_close(c);
        return;
    }
    memcpy(c->out, hdr, (size_t)n);
    if (!head)
        memcpy(c->out + n, body, blen);
    free(body);
    c->outlen = total;
    c->outoff = 0;
    c->since = idemp_now_ms();
}

/* A complete request head is in c->in: answer it. */
static void serve(idemp_http_t *h, conn_t *c)
{
    char method[8], path[256];
    if (sscanf(c->in, "%7s %255s", method, path) != 2) {
        respond(h, c, 400, "Bad Request", "bad request\n", false, "text/plain");
        return;
    }
    bool get = strcmp(method, "GET") == 0, head = strcmp(method, "HEAD") == 0;
    char *q = strchr(path, '?');
    if (q != NULL)
        *q = '\0';
    if (!get && !head)
        respond(h, c, 405, "Method Not Allowed", "only GET and HEAD\n", false, "text/plain");
    else if (strcmp(path, "/healthz") == 0) {
        char line[128];
        int status = h->health(h->ud, line, sizeof line);
        respond(h, c, status, status == 200 ? "OK" : "Service Unavailable", line, head,
                "text/plain; charset=utf-8");
    } else if (strcmp(path, "/metrics") != 0)
        respond(h, c, 404, "Not Found", "not found; try /metrics or /healthz\n", head,
                "text/plain");
    else
        respond(h, c, 200, "OK", NULL, head, "text/plain; version=0.0.4; charset=utf-8");
}

static void on_readable(idemp_http_t *h, conn_t *c)
{
    ssize_t n = read(c->fd, c->in + c->inlen, sizeof c->in - 1 - c->inlen);
    if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        conn_close(c);
        return;
    }
    c->inlen += (size_t)n;
    c->in[c->inlen] = '\0';
    if (strstr(c->in, "\r\n\r\n") != NULL || strstr(c->in, "\n\n") != NULL)
        serve(h, c);
    else if (c->inlen == sizeof c->in - 1)
        respond(h, c, 431, "Request Header Fields Too Large", "request header too large\n", false,
                "text/plain");
}

static void on_writable(conn_t *c)
{
    ssize_t n = send(c->fd, c->out + c->outoff, c->outlen - c->outoff, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        conn_close(c);
        return;
    }
    c->outoff += (size_t)n;
    if (c->outoff == c->outlen)
        conn_close(c);
}

/* A slot for a new connection: a free one, else the oldest still reading its request. */
static conn_t *slot(idemp_http_t *h)
{
    conn_t *oldest = NULL;
    for (int i = 0; i < HTTP_CONNS; i++) {
        conn_t *c = &h->conns[i];
        if (c->fd < 0)
            return c;
        if (c->out == NULL && (oldest == NULL || c->since < oldest->since))
            oldest = c;
    }
    if (oldest != NULL)
        conn_close(oldest);
    return oldest;
}

static void accept_all(idemp_http_t *h)
{
    for (;;) {
        int fd = accept4(h->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return; /* EAGAIN, or out of descriptors: the rest wait in the backlog */
        conn_t *c = slot(h);
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->fd = fd;
        c->since = idemp_now_ms();
        c->inlen = 0;
    }
}

static void *loop(void *arg)
{
    idemp_http_t *h = arg;
    struct pollfd pfd[HTTP_CONNS + 2];
    while (!atomic_load(&h->stop)) {
        int64_t now = idemp_now_ms();
        int n = 0;
        pfd[n++] = (struct pollfd){h->listen_fd, POLLIN, 0};
        pfd[n++] = (struct pollfd){h->wake[0], POLLIN, 0};
        int map[HTTP_CONNS];
        for (int i = 0; i < HTTP_CONNS; i++) {
            conn_t *c = &h->conns[i];
            if (c->fd >= 0 && now - c->since > (c->out ? HTTP_WRITE_MS : HTTP_READ_MS))
                conn_close(c);
            if (c->fd < 0)
                continue;
            map[n - 2] = i;
            pfd[n++] = (struct pollfd){c->fd, c->out ? POLLOUT : POLLIN, 0};
        }
        if (poll(pfd, (nfds_t)n, 200) <= 0)
            continue;
        for (int k = 2; k < n; k++) {
            conn_t *c = &h->conns[map[k - 2]];
            if (pfd[k].revents & (POLLERR | POLLNVAL))
                conn_close(c);
            else if (pfd[k].revents & POLLOUT)
                on_writable(c);
            else if (pfd[k].revents & (POLLIN | POLLHUP))
                on_readable(h, c);
        }
        if (pfd[0].revents & POLLIN)
            accept_all(h);
    }
    return NULL;
}

idemp_http_t *idemp_http_start(int listen_fd, idemp_http_render_fn render,
                               idemp_http_health_fn health, void *ud, idem_error_t *err)
{
    idemp_http_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        return NULL;
    }
    h->listen_fd = listen_fd;
    h->render = render;
    h->health = health;
    h->ud = ud;
    for (int i = 0; i < HTTP_CONNS; i++)
        h->conns[i].fd = -1;
    atomic_init(&h->stop, false);
    if (pipe2(h->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        idem_error_set(err, IDEM_ERR_IO, "metrics: pipe: %s", strerror(errno));
        free(h);
        return NULL;
    }
    fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
    int rc = pthread_create(&h->thread, NULL, loop, h);
    if (rc != 0) {
        idem_error_set(err, IDEM_ERR_IO, "metrics: cannot start a thread: %s", strerror(rc));
        close(h->wake[0]);
        close(h->wake[1]);
        free(h);
        return NULL;
    }
    return h;
}

void idemp_http_stop(idemp_http_t *h)
{
    if (h == NULL)
        return;
    atomic_store(&h->stop, true);
    ssize_t w = write(h->wake[1], "x", 1);
    (void)w;
    pthread_join(h->thread, NULL);
    for (int i = 0; i < HTTP_CONNS; i++)
        conn_close(&h->conns[i]);
    close(h->wake[0]);
    close(h->wake[1]);
    close(h->listen_fd);
    free(h);
}
