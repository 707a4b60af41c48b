/* rmq_url.c - amqp:// and amqps:// URLs with RabbitMQ's query parameters. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rmq.h"

/* ---- URLs --------------------------------------------------------------------------------- */

static int unhex(int ch)
{
    if (isdigit(ch))
        return ch - '0';
    ch = tolower(ch);
    return (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10 : -1;
}

/* Copies [s, s+n) percent-decoded into out; false when it does not fit or is malformed. */
static bool decode(const char *s, size_t n, char *out, size_t outsz)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int ch = (unsigned char)s[i];
        if (ch == '%') {
            if (i + 2 >= n)
                return false;
            int hi = unhex((unsigned char)s[i + 1]);
            int lo = unhex((unsigned char)s[i + 2]);
            if (hi < 0 || lo < 0)
                return false;
            ch = hi * 16 + lo;
            i += 2;
        }
        if (o + 1 >= outsz)
            return false;
        out[o++] = (char)ch;
    }
    out[o] = '\0';
    return true;
}

static bool parse_port(const char *s, const char *end, int *out)
{
    long port = 0;
    if (s == end)
        return false;
    for (const char *q = s; q < end; q++) {
        if (!isdigit((unsigned char)*q))
            return false;
        port = port * 10 + (*q - '0');
        if (port > 65535)
            return false;
    }
    if (port == 0)
        return false;
    *out = (int)port;
    return true;
}

/* key=value&... after '?'. Unknown keys are ignored, as RabbitMQ's clients do. */
static int parse_query(const char *q, idemp_amqp_url_t *u)
{
    while (*q != '\0' && *q != '#') {
        size_t n = strcspn(q, "&#");
        const char *eq = memchr(q, '=', n);
        char key[64], val[256];
        if (eq == NULL || (size_t)(eq - q) >= sizeof key)
            return IDEM_ERR_INVALID;
        memcpy(key, q, (size_t)(eq - q));
        key[eq - q] = '\0';
        if (!decode(eq + 1, n - (size_t)(eq - q) - 1, val, sizeof val))
            return IDEM_ERR_INVALID;
        if (strcmp(key, "heartbeat") == 0) {
            char *e;
            long v = strtol(val, &e, 10);
            if (*val == '\0' || *e != '\0' || v < 0 || v > 65535)
                return IDEM_ERR_INVALID;
            u->heartbeat_s = (int)v;
        } else if (strcmp(key, "cacertfile") == 0) {
            snprintf(u->cacertfile, sizeof u->cacertfile, "%s", val);
        } else if (strcmp(key, "certfile") == 0) {
            snprintf(u->certfile, sizeof u->certfile, "%s", val);
        } else if (strcmp(key, "keyfile") == 0) {
            snprintf(u->keyfile, sizeof u->keyfile, "%s", val);
        } else if (strcmp(key, "server_name_indication") == 0) {
            snprintf(u->sni, sizeof u->sni, "%s", val);
        } else if (strcmp(key, "verify") == 0) {
            if (strcmp(val, "verify_peer") == 0)
                u->verify_peer = true;
            else if (strcmp(val, "verify_none") == 0)
                u->verify_peer = false;
            else
                return IDEM_ERR_INVALID;
        }
        q += n;
        if (*q == '&')
            q++;
    }
    return IDEM_OK;
}

int idemp_amqp_url_parse(const char *url, idemp_amqp_url_t *u)
{
    memset(u, 0, sizeof *u);
    u->heartbeat_s = -1;
    u->verify_peer = true;
    if (url == NULL)
        return IDEM_ERR_INVALID;
    /* RFC 3986 has no raw blank, control character or non-ASCII byte in a URL: such a byte
     * must be percent-encoded, so that where a password ends is never in doubt (for the
     * masking of log lines too) */
    for (const unsigned char *b = (const unsigned char *)url; *b != '\0'; b++)
        if (*b <= 0x20 || *b >= 0x7f)
            return IDEM_ERR_INVALID;
    const char *p;
    if (strncmp(url, "amqp://", 7) == 0) {
        p = url + 7;
    } else if (strncmp(url, "amqps://", 8) == 0) {
        p = url + 8;
        u->tls = true;
    } else {
        return IDEM_ERR_INVALID;
    }
    const char *end = p + strcspn(p, "/?#");
    const char *at = NULL;
    for (const char *q = p; q < end; q++)
        if (*q == '@')
            at = q;
    strcpy(u->user, "guest");
    strcpy(u->password, "guest");
    if (at != NULL) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        if (colon != NULL) {
            if (!decode(p, (size_t)(colon - p), u->user, sizeof u->user) ||
                !decode(colon + 1, (size_t)(at - colon - 1), u->password, sizeof u->password))
                return IDEM_ERR_INVALID;
        } else if (!decode(p, (size_t)(at - p), u->user, sizeof u->user)) {
            return IDEM_ERR_INVALID;
        }
        p = at + 1;
    }
    const char *colon = NULL;
    if (*p == '[') { /* [ipv6]:port */
        const char *rb = memchr(p, ']', (size_t)(end - p));
        if (rb == NULL || (size_t)(rb - p - 1) >= sizeof u->host)
            return IDEM_ERR_INVALID;
        memcpy(u->host, p + 1, (size_t)(rb - p - 1));
        colon = rb + 1 < end && rb[1] == ':' ? rb + 1 : NULL;
        if (rb + 1 < end && colon == NULL)
            return IDEM_ERR_INVALID;
    } else {
        colon = memchr(p, ':', (size_t)(end - p));
        const char *hend = colon ? colon : end;
        if ((size_t)(hend - p) >= sizeof u->host)
            return IDEM_ERR_INVALID;
        memcpy(u->host, p, (size_t)(hend - p));
    }
    if (u->host[0] == '\0')
        strcpy(u->host, "localhost");
    u->port = u->tls ? 5671 : 5672;
    if (colon != NULL && !parse_port(colon + 1, end, &u->port))
        return IDEM_ERR_INVALID;
    const char *path = end;
    if (*path == '/')
        path++;
    size_t plen = strcspn(path, "?#");
    if (plen == 0)
        strcpy(u->vhost, "/");
    else if (!decode(path, plen, u->vhost, sizeof u->vhost))
        return IDEM_ERR_INVALID;
    if (path[plen] == '?')
        return parse_query(path + plen + 1, u);
    return IDEM_OK;
}
