/* mask.c - hiding passwords in URLs, conninfo strings and libpq's messages. */
#include <ctype.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "mask.h"

#define MASK "***"

static void put(char *out, size_t outsz, size_t *o, char ch)
{
    if (*o + 1 < outsz)
        out[(*o)++] = ch;
}

static void puts_n(char *out, size_t outsz, size_t *o, const char *s)
{
    while (*s)
        put(out, outsz, o, *s++);
}

static void put_span(char *out, size_t outsz, size_t *o, const char *s, size_t n)
{
    for (size_t k = 0; k < n; k++)
        put(out, outsz, o, s[k]);
}

static bool scheme_char(int ch)
{
    return isalnum(ch) || ch == '+' || ch == '-' || ch == '.';
}

/* ---- URLs: scheme://user:SECRET@host... ----------------------------------------------------- */

/* The end of the URL whose authority starts at in+i (just after "://"), for masking: the first
 * whitespace (unless past_spaces), or the scheme of the next URL of a comma-separated list. */
static size_t url_end(const char *in, size_t i, bool past_spaces)
{
    size_t j = i;
    for (; in[j] != '\0' && (past_spaces || !isspace((unsigned char)in[j])); j++) {
        if (in[j] == ':' && in[j + 1] == '/' && in[j + 2] == '/') {
            size_t s = j;
            while (s > i && scheme_char((unsigned char)in[s - 1]))
                s--;
            if (s < j)
                return s;
        }
    }
    return j;
}

/* Is [s, e) a host list as URLs write it: host[:port] or [ipv6][:port], comma-separated? */
static bool hosts_only(const char *s, const char *e)
{
    while (s < e) {
        const char *part_end = memchr(s, ',', (size_t)(e - s));
        if (part_end == NULL)
            part_end = e;
        const char *colon;
        if (*s == '[') {
            const char *rb = memchr(s, ']', (size_t)(part_end - s));
            if (rb == NULL)
                return false;
            colon = rb + 1 < part_end ? rb + 1 : NULL;
            if (colon != NULL && *colon != ':')
                return false;
        } else {
            colon = memchr(s, ':', (size_t)(part_end - s));
        }
        if (colon != NULL)
            for (const char *p = colon + 1; p < part_end; p++)
                if (!isdigit((unsigned char)*p))
                    return false;
        s = part_end < e ? part_end + 1 : e;
    }
    return true;
}

/* Where the userinfo of the URL whose authority starts at in+i ends (its '@'), or 0 if it has
 * none. As URL parsers read it: the last '@' before the first '/', '?' or '#', else (libpq) the
 * first '@' before the first '/'. An authority
 * without '@' that is no host[:port] list (say "user:pa") may be "user:password" whose password
 * holds an unencoded '/', '?', '#' or space (an invalid URL, so printed as given in an error):
 * then the last '@' before the next URL or the end of the text ends it. */
static size_t userinfo_end(const char *in, size_t i)
{
    size_t end = url_end(in, i, false), auth = i, at = 0;
    while (auth < end && in[auth] != '/' && in[auth] != '?' && in[auth] != '#')
        auth++;
    for (size_t k = i; k < auth; k++)
        if (in[k] == '@')
            at = k;
    /* none there: libpq looks for a PostgreSQL URI's '@' up to the first '/', past a '?' or '#' */
    for (size_t k = auth; at == 0 && k < end && in[k] != '/'; k++)
        if (in[k] == '@')
            at = k;
    if (at == 0 && !hosts_only(in + i, in + auth)) {
        end = url_end(in, i, true);
        for (size_t k = auth; k < end; k++)
            if (in[k] == '@')
                at = k;
    }
    return at;
}

/* ---- conninfo keywords: password=SECRET, sslpassword='SE CRET', ?password=SECRET& ------------ */

/* Length of the secret-bearing keyword at in+i ("password", "sslpassword", any case) when it is a
 * whole word followed by '=', else 0; *value is where its value starts. */
static size_t secret_keyword(const char *in, size_t i, size_t *value)
{
    static const char *const words[] = {"password", "sslpassword", NULL};
    if (i > 0 && (isalnum((unsigned char)in[i - 1]) || in[i - 1] == '_'))
        return 0;
    for (const char *const *w = words; *w != NULL; w++) {
        size_t n = strlen(*w);
        if (strncasecmp(in + i, *w, n) != 0)
            continue;
        size_t j = i + n;
        while (in[j] != '\0' && isspace((unsigned char)in[j]))
            j++;
        if (in[j] != '=')
            continue;
        j++;
        while (in[j] != '\0' && isspace((unsigned char)in[j]))
            j++;
        *value = j;
        return n;
    }
    return 0;
}

/* The end of a keyword's value starting at in+j. In a URI's query (the keyword follows '?' or
 * '&'): up to '&', '#' or whitespace. Else as libpq reads conninfo: quoted, up to the closing
 * quote (backslash escapes); bare, up to whitespace that no backslash escapes. */
static size_t value_end(const char *in, size_t j, bool query)
{
    if (!query && in[j] == '\'') {
        for (j++; in[j] != '\0' && in[j] != '\''; j++)
            if (in[j] == '\\' && in[j + 1] != '\0')
                j++;
        return in[j] == '\'' ? j + 1 : j;
    }
    /* libpq takes a URI's query value raw up to the next '&' ('#' included; a raw blank in a
     * URI is refused before libpq sees it, see pg.c) */
    for (; in[j] != '\0' && !isspace((unsigned char)in[j]); j++) {
        if (query && in[j] == '&')
            break;
        if (!query && in[j] == '\\' && in[j + 1] != '\0')
            j++;
    }
    return j;
}

/* A span masked from in+from to in+end must not end inside the value of a secret keyword that
 * starts in it: a URI's fragment inside a keyword/value conninfo (a host value that holds "://",
 * say) can put the '@' it masks to in the middle of a password=... that libpq reads up to the
 * next blank. Returns end, moved past every such value (a keyword after '?' or '&' is taken to
 * its longer reading, up to the blank, since which reading libpq uses depends on the rest). */
static size_t past_secret_values(const char *in, size_t from, size_t end)
{
    for (size_t k = from; k < end && in[k] != '\0'; k++) {
        size_t v;
        if (secret_keyword(in, k, &v) == 0)
            continue;
        size_t e = value_end(in, v, false), eq = value_end(in, v, true);
        if (eq > e)
            e = eq;
        if (e > end)
            end = e;
    }
    return end;
}

/* ---- libpq's messages that quote a piece of the conninfo ---------------------------------- */

/* libpq quotes the undecodable token of a URI (a password with a '%' that is not an escape) and
 * a port that is not a number (a URI whose password holds an unencoded '/'), and names a host
 * that holds an unencoded '@' of a password. Returns the end of the masked part of the message
 * starting at in+i and sets *open to where the quoted text starts (after the quote), or
 * returns 0 when no such message starts at in+i. */
static size_t libpq_quoted(const char *in, size_t i, size_t *open)
{
    static const struct {
        const char *prefix, *suffix; /* suffix NULL: up to the last '"' of the text */
        bool to_last_at;             /* mask up to the last '@' of the quoted text only */
    } msgs[] = {
        {"percent-encoded token: \"", NULL, false},
        {"percent-encoded value: \"", NULL, false},
        {"invalid integer value \"", "\" for connection option \"port\"", false},
        {"could not translate host name \"", "\" to address", true},
    };
    for (size_t m = 0; m < sizeof msgs / sizeof msgs[0]; m++) {
        size_t n = strlen(msgs[m].prefix);
        if (strncmp(in + i, msgs[m].prefix, n) != 0)
            continue;
        const char *start = in + i + n, *end;
        if (msgs[m].suffix == NULL) {
            end = strrchr(start, '"');
            if (end == NULL)
                end = start + strlen(start);
        } else if ((end = strstr(start, msgs[m].suffix)) == NULL) {
            continue;
        }
        if (msgs[m].to_last_at) {
            const char *at = NULL;
            for (const char *p = start; p < end; p++)
                if (*p == '@')
                    at = p;
            if (at == NULL)
                continue;
            end = at;
        }
        *open = i + n;
        return (size_t)(end - in);
    }
    return 0;
}

void idemp_mask_secrets(const char *in, char *out, size_t outsz)
{
    size_t o = 0;
    if (outsz == 0)
        return;
    for (size_t i = 0; in[i];) {
        if (in[i] == ':' && in[i + 1] == '/' && in[i + 2] == '/') {
            puts_n(out, outsz, &o, "://");
            i += 3;
            size_t at = userinfo_end(in, i);
            const char *colon = at ? memchr(in + i, ':', at - i) : NULL;
            /* a query's password keyword before that '@': the '@' may be inside its value (a
             * URI without userinfo, as libpq reads one) or the keyword inside the userinfo's
             * password; either way everything from the first of ':' and the keyword up to the
             * end of that value is masked */
            size_t kw = 0, kwlen = 0, v;
            for (size_t k = i; colon != NULL && k < at && kwlen == 0; k++)
                if (in[k - 1] == '?' || in[k - 1] == '&')
                    kwlen = secret_keyword(in, kw = k, &v);
            if (kwlen != 0 && in + kw < colon) {
                put_span(out, outsz, &o, in + i, kw + kwlen - i);
                puts_n(out, outsz, &o, "=" MASK);
                i = past_secret_values(in, kw + kwlen, value_end(in, at, true));
            } else if (colon != NULL) {
                put_span(out, outsz, &o, in + i, (size_t)(colon - (in + i)));
                puts_n(out, outsz, &o, ":" MASK);
                /* without such a keyword, the '@' and the host are copied as they are */
                size_t from = (size_t)(colon - in) + 1;
                i = past_secret_values(in, from, kwlen != 0 ? value_end(in, at, true) : at);
            }
            continue;
        }
        size_t value, n = secret_keyword(in, i, &value);
        if (n != 0) {
            bool query = i > 0 && (in[i - 1] == '?' || in[i - 1] == '&');
            put_span(out, outsz, &o, in + i, n);
            puts_n(out, outsz, &o, "=" MASK);
            i = value_end(in, value, query);
            continue;
        }
        size_t open, end = libpq_quoted(in, i, &open);
        if (end != 0) {
            put_span(out, outsz, &o, in + i, open - i);
            puts_n(out, outsz, &o, MASK);
            i = end;
            continue;
        }
        put(out, outsz, &o, in[i++]);
    }
    out[o] = '\0';
}

void idemp_mask_unparsed_url(const char *in, char *out, size_t outsz)
{
    size_t o = 0;
    if (outsz == 0)
        return;
    const char *at = strrchr(in, '@');
    if (at == NULL) {
        puts_n(out, outsz, &o, in);
    } else {
        const char *sep = strstr(in, "://");
        const char *from = sep != NULL && sep < at ? sep + 3 : in;
        put_span(out, outsz, &o, in, (size_t)(from - in));
        puts_n(out, outsz, &o, MASK);
        puts_n(out, outsz, &o, at);
    }
    out[o] = '\0';
}

char *idemp_vformat(const char *fmt, va_list ap)
{
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n < 0)
        return NULL;
    char *s = malloc((size_t)n + 1);
    if (s != NULL)
        vsnprintf(s, (size_t)n + 1, fmt, ap);
    return s;
}

void idemp_mask_line(const char *in, char *out, size_t outsz)
{
    size_t len = strlen(in);
    char *flat = malloc(len + 1);
    if (flat == NULL) {
        snprintf(out, outsz, "(message lost: out of memory)");
        return;
    }
    for (size_t i = 0; i <= len; i++)
        flat[i] = (in[i] == '\n' || in[i] == '\r' || in[i] == '\t') ? ' ' : in[i];
    while (len > 0 && flat[len - 1] == ' ')
        flat[--len] = '\0';
    idemp_mask_secrets(flat, out, outsz);
    free(flat);
}
