/* metrics_http.c - the /metrics endpoint: a small HTTP/1.x server on its own thread; the console
 * serves its page and API through the same loop with a handler of its own. The loop only reads
 * and writes sockets; a handler's request that may wait on a server (a query, a requeue walking a
 * DLQ) runs on one of HTTP_WORKERS threads, so at most that many run at once and none of them
 * holds up the loop: other connections are read, answered and timed out meanwhile. More such
 * requests wait for a free thread, their connections held (at most HTTP_CONNS in all).
 *
 * It answers GET and HEAD /metrics and /healthz (404 for other paths, 405 for other methods;
 * /healthz is 200 or 503 with one line, see idemp_metrics_healthz) and closes each connection after
 * its answer. It holds at most HTTP_CONNS connections: when a new one arrives and all are taken,
 * the oldest that has not finished sending its request is closed, so connections that open and send
 * nothing (or dribble) can never keep a scrape out; a request must arrive within HTTP_READ_MS. One
 * poll loop, no allocation per byte. */
#define _GNU_SOURCE /* accept4, pipe2 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
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
#define HTTP_IN_MAX (HTTP_REQ_MAX + IDEMP_HTTP_BODY_MAX)
#define HTTP_WORKERS 4

typedef struct conn {
    int fd; /* -1 when free */
    int64_t since;
    char in[HTTP_IN_MAX];
    size_t inlen;
    char *out; /* the whole response, written as the socket takes it */
    size_t outlen, outoff;
    /* a request handed to a worker: busy until its answer is back (the loop leaves the
     * connection alone meanwhile: no reads, no deadline) */
    bool busy, head_only;
    char head[HTTP_REQ_MAX], method[8], path[1024];
    idemp_http_req_t req;
    idemp_http_resp_t resp;
} conn_t;

struct idemp_http {
    int listen_fd;
    int wake[2]; /* a pipe: stop */
    idemp_http_render_fn render;
    idemp_http_health_fn health;
    idemp_http_handler_fn handler; /* NULL: /metrics */
    idemp_http_quick_fn quick;     /* NULL: every request of handler goes to a worker */
    void *ud;
    pthread_t thread;
    atomic_bool stop;
    conn_t conns[HTTP_CONNS];
    /* the workers: todo holds connections waiting for one, done those answered (rings of
     * connection numbers, under mu); a worker that finishes writes to wake */
    pthread_t workers[HTTP_WORKERS];
    int nworkers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool quit; /* under mu: the workers stop */
    int todo[HTTP_CONNS], ntodo, todo_head;
    int done[HTTP_CONNS], ndone;
};

static void conn_close(conn_t *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->out);
    c->fd = -1;
    c->out = NULL;
    c->inlen = c->outlen = c->outoff = 0;
    c->busy = false;
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

static void serve_handler(idemp_http_t *h, conn_t *c, char *end);

static void on_readable(idemp_http_t *h, conn_t *c)
{
    size_t room = (h->handler ? sizeof c->in : HTTP_REQ_MAX) - 1 - c->inlen;
    ssize_t n = read(c->fd, c->in + c->inlen, room);
    if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        conn_close(c);
        return;
    }
    c->inlen += (size_t)n;
    c->in[c->inlen] = '\0';
    char *end = strstr(c->in, "\r\n\r\n");
    if (h->handler != NULL && (end != NULL || (end = strstr(c->in, "\n\n")) != NULL))
        serve_handler(h, c, end);
    else if (strstr(c->in, "\r\n\r\n") != NULL || strstr(c->in, "\n\n") != NULL)
        serve(h, c);
    else if (c->inlen >= HTTP_REQ_MAX - 1)
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
        if (c->out == NULL && !c->busy && (oldest == NULL || c->since < oldest->since))
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

static void send_resp(conn_t *c, idemp_http_resp_t *r, bool head);

/* The workers' answers that are back: sent from here on like any other. */
static void take_answers(idemp_http_t *h)
{
    char buf[64];
    while (read(h->wake[0], buf, sizeof buf) > 0) {
    }
    int done[HTTP_CONNS], n;
    pthread_mutex_lock(&h->mu);
    n = h->ndone;
    memcpy(done, h->done, sizeof(int) * (size_t)n);
    h->ndone = 0;
    pthread_mutex_unlock(&h->mu);
    for (int k = 0; k < n; k++) {
        conn_t *c = &h->conns[done[k]];
        c->busy = false;
        send_resp(c, &c->resp, c->head_only);
    }
}

static void *worker(void *arg)
{
    idemp_http_t *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (h->ntodo == 0 && !h->quit)
            pthread_cond_wait(&h->cv, &h->mu);
        if (h->quit)
            break;
        int i = h->todo[h->todo_head];
        h->todo_head = (h->todo_head + 1) % HTTP_CONNS;
        h->ntodo--;
        pthread_mutex_unlock(&h->mu);
        conn_t *c = &h->conns[i];
        h->handler(h->ud, &c->req, &c->resp);
        pthread_mutex_lock(&h->mu);
        h->done[h->ndone++] = i;
        ssize_t w = write(h->wake[1], "x", 1);
        (void)w;
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
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
            if (c->busy)
                continue;
            if (c->fd >= 0 && now - c->since > (c->out ? HTTP_WRITE_MS : HTTP_READ_MS))
                conn_close(c);
            if (c->fd < 0)
                continue;
            map[n - 2] = i;
            pfd[n++] = (struct pollfd){c->fd, c->out ? POLLOUT : POLLIN, 0};
        }
        if (poll(pfd, (nfds_t)n, 200) <= 0)
            continue;
        if (pfd[1].revents & POLLIN)
            take_answers(h);
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

static void stop_workers(idemp_http_t *h)
{
    pthread_mutex_lock(&h->mu);
    h->quit = true;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; i < h->nworkers; i++)
        pthread_join(h->workers[i], NULL); /* each finishes the request in hand */
    h->nworkers = 0;
}

static idemp_http_t *start(int listen_fd, idemp_http_render_fn render, idemp_http_health_fn health,
                           idemp_http_handler_fn handler, idemp_http_quick_fn quick, void *ud,
                           idem_error_t *err)
{
    idemp_http_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
        return NULL;
    }
    h->listen_fd = listen_fd;
    h->render = render;
    h->health = health;
    h->handler = handler;
    h->quick = quick;
    h->ud = ud;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    for (int i = 0; i < HTTP_CONNS; i++)
        h->conns[i].fd = -1;
    atomic_init(&h->stop, false);
    if (pipe2(h->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        idem_error_set(err, IDEM_ERR_IO, "metrics: pipe: %s", strerror(errno));
        free(h);
        return NULL;
    }
    fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
    int rc = 0;
    for (int i = 0; handler != NULL && i < HTTP_WORKERS && rc == 0; i++)
        if ((rc = pthread_create(&h->workers[i], NULL, worker, h)) == 0)
            h->nworkers++;
    if (rc == 0)
        rc = pthread_create(&h->thread, NULL, loop, h);
    if (rc != 0) {
        idem_error_set(err, IDEM_ERR_IO, "metrics: cannot start a thread: %s", strerror(rc));
        stop_workers(h);
        pthread_mutex_destroy(&h->mu);
        pthread_cond_destroy(&h->cv);
        close(h->wake[0]);
        close(h->wake[1]);
        free(h);
        return NULL;
    }
    return h;
}

idemp_http_t *idemp_http_start(int listen_fd, idemp_http_render_fn render,
                               idemp_http_health_fn health, void *ud, idem_error_t *err)
{
    return start(listen_fd, render, health, NULL, NULL, ud, err);
}

idemp_http_t *idemp_http_start_handler(int listen_fd, idemp_http_handler_fn fn,
                                       idemp_http_quick_fn quick, void *ud, idem_error_t *err)
{
    return start(listen_fd, NULL, NULL, fn, quick, ud, err);
}

void idemp_http_stop(idemp_http_t *h)
{
    if (h == NULL)
        return;
    atomic_store(&h->stop, true);
    ssize_t w = write(h->wake[1], "x", 1);
    (void)w;
    pthread_join(h->thread, NULL);
    stop_workers(h);
    for (int i = 0; i < HTTP_CONNS; i++) {
        conn_t *c = &h->conns[i];
        bool answered = false;
        for (int k = 0; k < h->ndone; k++)
            answered = answered || h->done[k] == i;
        if (answered) /* an answer nobody will send */
            free(c->resp.body);
        conn_close(c);
    }
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    close(h->wake[0]);
    close(h->wake[1]);
    close(h->listen_fd);
    free(h);
}

/* ---- an application's requests ------------------------------------------------------------ */

static const char *reason_of(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 409:
        return "Conflict";
    case 411:
        return "Length Required";
    case 413:
        return "Content Too Large";
    case 415:
        return "Unsupported Media Type";
    case 431:
        return "Request Header Fields Too Large";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    default:
        return status >= 500 ? "Internal Server Error" : "Error";
    }
}

static void send_resp(conn_t *c, idemp_http_resp_t *r, bool head)
{
    char hdr[2048];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n%s\r\n",
                     r->status, reason_of(r->status), r->ctype ? r->ctype : "application/json",
                     r->body ? r->len : 0, r->headers ? r->headers : "");
    size_t blen = head || r->body == NULL ? 0 : r->len;
    c->out = n > 0 && (size_t)n < sizeof hdr ? malloc((size_t)n + blen) : NULL;
    if (c->out == NULL) {
        free(r->body);
        conn_close(c);
        return;
    }
    memcpy(c->out, hdr, (size_t)n);
    if (blen > 0)
        memcpy(c->out + n, r->body, blen);
    free(r->body);
    c->outlen = (size_t)n + blen;
    c->outoff = 0;
    c->since = idemp_now_ms();
}

static void send_text(conn_t *c, int status, const char *text)
{
    idemp_http_resp_t r = {status, "text/plain; charset=utf-8", strdup(text), strlen(text), NULL};
    send_resp(c, &r, false);
}

bool idemp_http_header(const idemp_http_req_t *req, const char *name, char *buf, size_t sz)
{
    size_t nl = strlen(name);
    const char *line = strchr(req->head, '\n');
    while (line != NULL && line[1] != '\0') {
        line++;
        if (strncasecmp(line, name, nl) == 0 && line[nl] == ':') {
            const char *v = line + nl + 1, *e = v;
            while (*v == ' ' || *v == '\t')
                v++;
            e = v + strcspn(v, "\r\n");
            while (e > v && (e[-1] == ' ' || e[-1] == '\t'))
                e--;
            if ((size_t)(e - v) >= sz)
                return false;
            memcpy(buf, v, (size_t)(e - v));
            buf[e - v] = '\0';
            return true;
        }
        line = strchr(line, '\n');
    }
    return false;
}

/* The head ends at end (its blank line): once the body Content-Length announces is in too,
 * call the handler. */
static void serve_handler(idemp_http_t *h, conn_t *c, char *end)
{
    const char *body = end + (end[0] == '\r' ? 4 : 2);
    size_t headlen = (size_t)(end - c->in);
    if (headlen >= HTTP_REQ_MAX) {
        send_text(c, 431, "request header too large\n");
        return;
    }
    char *head = c->head, *method = c->method, *path = c->path, len[24];
    memcpy(head, c->in, headlen);
    head[headlen] = '\0';
    idemp_http_req_t req = {method, path, "", head, body, 0};
    bool has_len = idemp_http_header(&req, "Content-Length", len, sizeof len);
    char *rest = NULL;
    unsigned long long want = has_len ? strtoull(len, &rest, 10) : 0;
    if (sscanf(head, "%7s %1023s", method, path) != 2 ||
        (has_len && (*rest != '\0' || !isdigit((unsigned char)len[0])))) {
        send_text(c, 400, "bad request\n");
        return;
    }
    if (want > IDEMP_HTTP_BODY_MAX) {
        send_text(c, 413, "request body too large\n");
        return;
    }
    if (c->inlen - (size_t)(body - c->in) < want)
        return; /* not all there yet: read on */
    c->in[(body - c->in) + want] = '\0';
    req.body_len = (size_t)want;
    char *q = strchr(path, '?');
    if (q != NULL) {
        *q = '\0';
        req.query = q + 1;
    }
    idemp_http_resp_t resp = {200, NULL, NULL, 0, NULL};
    bool head_only = strcmp(method, "HEAD") == 0;
    if (h->quick != NULL && h->quick(h->ud, &req)) {
        h->handler(h->ud, &req, &resp);
        send_resp(c, &resp, head_only);
        return;
    }
    c->req = req;
    c->resp = resp;
    c->head_only = head_only;
    c->busy = true;
    pthread_mutex_lock(&h->mu);
    h->todo[(h->todo_head + h->ntodo) % HTTP_CONNS] = (int)(c - h->conns);
    h->ntodo++;
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

int idemp_http_listen(const char *addr, int port, const char *what, idem_error_t *err)
{
    if (addr == NULL || *addr == '\0')
        addr = "127.0.0.1";
    if (port < 0 || port > 65535) {
        idem_error_set(err, IDEM_ERR_INVALID, "cannot serve %s on port %d: not a TCP port", what,
                       port);
        return -1;
    }
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
    char portstr[8];
    snprintf(portstr, sizeof portstr, "%d", port);
    int g = getaddrinfo(addr, portstr, &hints, &ai);
    if (g != 0) {
        idem_error_set(err, IDEM_ERR_INVALID,
                       "cannot serve %s on %s: not a numeric IP address (%s)", what, addr,
                       gai_strerror(g));
        return -1;
    }
    /* bound here, so that a port in use is reported with the kernel's own reason */
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        freeaddrinfo(ai);
        idem_error_set(err, IDEM_ERR_IO, "cannot serve %s on port %d at %s: socket: %s", what, port,
                       addr, strerror(errno));
        return -1;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* restart over TIME_WAIT */
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 512) != 0) {
        int e = errno;
        close(fd);
        freeaddrinfo(ai);
        idem_error_set(err, IDEM_ERR_IO, "cannot serve %s on port %d at %s: %s", what, port, addr,
                       strerror(e));
        return -1;
    }
    freeaddrinfo(ai);
    return fd;
}
