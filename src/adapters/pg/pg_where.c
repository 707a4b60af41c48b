/* pg_where.c - the "host:port" a conninfo names, for log and error lines: read the way libpq
 * reads it, never showing a piece of a password that libpq would misread. */
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "pg.h"

static bool port_ok(const char *port)
{
    if (port == NULL)
        return true;
    for (const char *p = port; *p; p++)
        if (!isdigit((unsigned char)*p) && *p != ',')
            return false;
    return true;
}

/* host and port of conninfo per libpq, or false when it does not parse. */
static bool parse_where(const char *conninfo, char *host, size_t hsz, char *port, size_t psz)
{
    char *errmsg = NULL;
    PQconninfoOption *opts = PQconninfoParse(conninfo, &errmsg);
    PQfreemem(errmsg);
    if (opts == NULL)
        return false;
    const char *h = NULL, *p = NULL;
    for (PQconninfoOption *q = opts; q->keyword; q++) {
        if (strcmp(q->keyword, "host") == 0 && q->val && *q->val)
            h = q->val;
        else if (strcmp(q->keyword, "hostaddr") == 0 && q->val && *q->val && !h)
            h = q->val;
        else if (strcmp(q->keyword, "port") == 0 && q->val && *q->val)
            p = q->val;
    }
    snprintf(host, hsz, "%s", h ? h : "");
    snprintf(port, psz, "%s", p ? p : "");
    PQconninfoFree(opts);
    return true;
}

/* A URI without its userinfo (up to the last '@' before the query), or NULL if it has none: a
 * password with an unencoded '@', '/' or '%' makes libpq misread or refuse the URI, and its host
 * or port would show a piece of the password. */
static char *uri_without_userinfo(const char *conninfo)
{
    const char *sep = strstr(conninfo, "://");
    if (sep == NULL ||
        (strncmp(conninfo, "postgresql://", 13) != 0 && strncmp(conninfo, "postgres://", 11) != 0))
        return NULL;
    const char *auth = sep + 3, *q = auth + strcspn(auth, "?"), *at = NULL;
    for (const char *p = auth; p < q; p++)
        if (*p == '@')
            at = p;
    if (at == NULL)
        return NULL;
    size_t n = (size_t)(auth - conninfo);
    char *s = malloc(n + strlen(at + 1) + 1);
    if (s != NULL) {
        memcpy(s, conninfo, n);
        strcpy(s + n, at + 1);
    }
    return s;
}

/* A URI with "://" past its scheme, an '@' in its path, or userinfo and an '@' past a '/' or '?':
 * libpq ends the authority at the first '/', so a password holding "://" or '@' and '/' leaves
 * part of itself in the host, port or database name, which errors and log lines show. Where that
 * password ends cannot be told, so idem refuses it. */
bool idemp_pg_uri_ambiguous(const char *conninfo)
{
    const char *p = NULL;
    if (strncmp(conninfo, "postgres://", 11) == 0)
        p = conninfo + 11;
    else if (strncmp(conninfo, "postgresql://", 13) == 0)
        p = conninfo + 13;
    if (p == NULL)
        return false;
    if (strstr(p, "://") != NULL)
        return true;
    const char *first = strchr(p, '@'), *last = strrchr(p, '@'), *slash = strchr(p, '/');
    if (first == NULL)
        return false;
    /* an '@' in the path (after the host, before any '?') */
    const char *at = slash ? strchr(slash, '@') : NULL, *q = slash ? strchr(slash, '?') : NULL;
    if (at != NULL && (q == NULL || at < q))
        return true;
    /* userinfo, and another '@' past a '/' or '?': the query's, or the password's end */
    return first != last && strcspn(first, "/?") < (size_t)(last - first);
}

void idemp_pg_where(const char *conninfo, char *out, size_t outsz)
{
    char hosts[512] = "", ports[128] = "";
    if (conninfo == NULL)
        conninfo = "";
    bool ok = !idemp_pg_uri_ambiguous(conninfo) &&
              parse_where(conninfo, hosts, sizeof hosts, ports, sizeof ports);
    if (!ok || strchr(hosts, '@') != NULL || !port_ok(ports)) {
        char *clean = uri_without_userinfo(conninfo);
        if (clean == NULL || !parse_where(clean, hosts, sizeof hosts, ports, sizeof ports))
            hosts[0] = ports[0] = '\0';
        free(clean);
        if (strchr(hosts, '@') != NULL || !port_ok(ports))
            hosts[0] = ports[0] = '\0'; /* still unreadable: libpq's defaults below */
    }
    const char *host = hosts[0] ? hosts : getenv("PGHOST");
    const char *port = ports[0] ? ports : getenv("PGPORT");
    host = host && *host ? host : "localhost";
    port = port && *port ? port : "5432";
    /* pair the lists: one port for every host, or one each */
    size_t o = 0;
    out[0] = '\0';
    const char *h = host, *pt = port;
    bool one_port = strchr(port, ',') == NULL;
    while (*h != '\0' && o + 1 < outsz) {
        size_t hl = strcspn(h, ","), pl = strcspn(pt, ",");
        int w = snprintf(out + o, outsz - o, "%s%.*s:%.*s", o ? "," : "", (int)hl, h, (int)pl, pt);
        if (w < 0 || (size_t)w >= outsz - o)
            break;
        o += (size_t)w;
        h += hl + (h[hl] == ',');
        if (!one_port && pt[pl] == ',')
            pt += pl + 1;
    }
}
