/* fuzz_amqp_url_mask.c - libFuzzer target for idemp_amqp_url_parse (src/adapters/rmq/rmq_url.c) and the
 * masking of secrets in log lines (src/util/mask.c: idemp_mask_secrets, idemp_mask_line).
 *
 * Input: a mode byte, an output-size byte, then the text. Mode bit 0 set: the text is used as
 * it is (a URL or a conninfo); clear: "amqp://" is put before it. Mode bit 2 set: the text is a
 * password length byte, the password and the rest, built into a URL whose password is written
 * unencoded ("://", '@', ',', quotes, blanks: whatever the input holds), by bits 3-4: amqp://,
 * amqps://, a list of two AMQP URLs, or postgresql://.
 *
 * Checked beyond memory safety (every output buffer is a heap block of exactly its size):
 * - a parsed URL's fields are NUL-terminated within their arrays, its port in 1-65535;
 * - whenever the URL parser accepts a URL with a password, neither the password as written nor
 *   as decoded appears in the masked text (idemp_mask_secrets, and idemp_mask_line whose input
 *   had tabs and newlines flattened), unless it also appears in the ideal masked text (the URL
 *   with the password replaced by "***");
 * - whenever libpq parses the text as a conninfo with a password or sslpassword, that value
 *   does not appear in the masked text unless it also appears elsewhere in the input;
 * - for a URL built with an unencoded password (bit 2) that the AMQP parser refuses, no piece of
 *   that password shows in the invalid-URL error's text (idemp_mask_unparsed_url); for a
 *   PostgreSQL URI, none in the server that messages name (idemp_pg_where), unless idem refuses
 *   the URI before libpq reads it (idemp_pg_uri_ambiguous). */
#include <ctype.h>

#include <libpq-fe.h>

#include "fuzz_common.h"
#include "mask.h"
#include "pg.h"
#include "rmq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool terminated(const char *s, size_t n)
{
    return memchr(s, '\0', n) != NULL;
}

static char *mask_with(void (*fn)(const char *, char *, size_t), const char *in, size_t outsz)
{
    char *out = malloc(outsz);
    fn(in, out, outsz);
    FZ_CHECK(outsz == 0 || terminated(out, outsz), "mask output unterminated");
    return out;
}

static void flatten(char *s)
{
    for (; *s; s++)
        if (*s == '\n' || *s == '\r' || *s == '\t')
            *s = ' ';
}

/* The URL as a perfect mask would print it: the password replaced by "***". */
static char *ideal_url(const char *url, size_t pw_at, size_t pw_len)
{
    size_t n = strlen(url);
    char *s = malloc(n + 4);
    memcpy(s, url, pw_at);
    memcpy(s + pw_at, "***", 3);
    memcpy(s + pw_at + 3, url + pw_at + pw_len, n - pw_at - pw_len + 1);
    return s;
}

/* No piece of secret (any run of 6 bytes of it, or all of it when shorter) may show in masked,
 * unless that piece is also in ideal: the text as a perfect mask would print it. */
static void no_leak(const char *what, const char *masked, const char *ideal, const char *secret,
                    const char *url)
{
    size_t n = strlen(secret), w = n < 6 ? n : 6;
    if (n < 3)
        return; /* too short to tell */
    char piece[7];
    for (size_t i = 0; i + w <= n; i++) {
        memcpy(piece, secret + i, w);
        piece[w] = '\0';
        if (strstr(ideal, piece) != NULL || strstr("sslpassword=***", piece) != NULL ||
            strstr("://:***@", piece) != NULL || strstr("localhost:5432", piece) != NULL ||
            strchr(piece, '*') != NULL)
            continue; /* printed legitimately elsewhere, or what the mask writes itself */
        FZ_CHECK(strstr(masked, piece) == NULL,
                 "%s leaks '%s' of the password '%s' of '%s' as '%s'", what, piece, secret, url,
                 masked);
    }
}

static void check_url(const char *url)
{
    idemp_amqp_url_t u;
    if (idemp_amqp_url_parse(url, &u) != IDEM_OK)
        return;
    FZ_CHECK(terminated(u.host, sizeof u.host) && terminated(u.user, sizeof u.user) &&
                 terminated(u.password, sizeof u.password) && terminated(u.vhost, sizeof u.vhost),
             "unterminated field");
    FZ_CHECK(u.port >= 1 && u.port <= 65535, "port %d", u.port);
    FZ_CHECK(u.heartbeat_s >= -1 && u.heartbeat_s <= 65535, "heartbeat %d", u.heartbeat_s);

    /* where the password is written: between the first ':' of the userinfo and its last '@' */
    const char *p = url + (u.tls ? 8 : 7);
    const char *end = p + strcspn(p, "/?#");
    const char *at = NULL;
    for (const char *q = p; q < end; q++)
        if (*q == '@')
            at = q;
    if (at == NULL)
        return;
    const char *colon = memchr(p, ':', (size_t)(at - p));
    if (colon == NULL)
        return;
    size_t pw_at = (size_t)(colon + 1 - url), pw_len = (size_t)(at - colon - 1);
    char *raw = fz_dup((const uint8_t *)colon + 1, pw_len, 1);
    char *ideal = ideal_url(url, pw_at, pw_len);
    size_t big = strlen(url) * 2 + 64;

    char *m = mask_with(idemp_mask_secrets, url, big);
    no_leak("idemp_mask_secrets", m, ideal, raw, url);
    no_leak("idemp_mask_secrets", m, ideal, u.password, url);
    free(m);

    char *flat_ideal = strdup(ideal), *flat_raw = strdup(raw), *flat_pw = strdup(u.password);
    flatten(flat_ideal);
    flatten(flat_raw);
    flatten(flat_pw);
    /* mask_line also drops trailing blanks: judge against the ideal trimmed the same way */
    m = mask_with(idemp_mask_line, url, big);
    no_leak("idemp_mask_line", m, flat_ideal, flat_raw, url);
    no_leak("idemp_mask_line", m, flat_ideal, flat_pw, url);
    free(m);
    free(flat_ideal);
    free(flat_raw);
    free(flat_pw);
    free(ideal);
    free(raw);
}

static void check_conninfo(const char *text)
{
    /* a percent-encoded URI: the value libpq decodes is not where the text shows it */
    if (strchr(text, '%') != NULL)
        return;
    /* idem refuses a URI with a raw blank or control character before libpq sees it (pg.c) */
    if (strncmp(text, "postgres://", 11) == 0 || strncmp(text, "postgresql://", 13) == 0)
        for (const unsigned char *b = (const unsigned char *)text; *b != '\0'; b++)
            if (*b <= 0x20 || *b == 0x7f)
                return;
    char *errmsg = NULL;
    PQconninfoOption *opts = PQconninfoParse(text, &errmsg);
    PQfreemem(errmsg);
    if (opts == NULL)
        return;
    size_t big = strlen(text) * 2 + 64;
    char *m = mask_with(idemp_mask_secrets, text, big);
    for (PQconninfoOption *o = opts; o->keyword; o++) {
        if ((strcmp(o->keyword, "password") != 0 && strcmp(o->keyword, "sslpassword") != 0) ||
            o->val == NULL || strlen(o->val) < 4)
            continue;
        /* only a value written once, literally: otherwise it may be printed legitimately */
        const char *first = strstr(text, o->val);
        if (first == NULL || strstr(first + 1, o->val) != NULL)
            continue;
        /* the text as a perfect mask would print it: the value replaced by "***" */
        size_t at = (size_t)(first - text), vl = strlen(o->val);
        char *ideal = malloc(strlen(text) + 4);
        memcpy(ideal, text, at);
        memcpy(ideal + at, "***", 3);
        strcpy(ideal + at + 3, text + at + vl);
        no_leak(o->keyword, m, ideal, o->val, text);
        free(ideal);
    }
    free(m);
    PQconninfoFree(opts);
}

/* bit 2: "SCHEME://u:" PASSWORD "@" REST, the password as the input has it */
static void check_unencoded(const uint8_t *data, size_t n, uint8_t mode)
{
    if (n < 1)
        return;
    size_t pl = data[0] < n - 1 ? data[0] : n - 1;
    const uint8_t *pw = data + 1, *rest = pw + pl;
    size_t rl = n - 1 - pl;
    if (memchr(data + 1, '\0', n - 1) != NULL)
        return;
    static const char *const prefix[] = {"amqp://u:", "amqps://u:", "amqp://a:x@h1,amqp://u:",
                                         "postgresql://u:"};
    const char *pre = prefix[(mode >> 3) & 3];
    size_t prel = strlen(pre);
    char *url = malloc(prel + pl + 1 + rl + 1);
    memcpy(url, pre, prel);
    memcpy(url + prel, pw, pl);
    url[prel + pl] = '@';
    memcpy(url + prel + pl + 1, rest, rl);
    url[prel + pl + 1 + rl] = '\0';
    char *secret = fz_dup(pw, pl, 1);
    char *ideal = ideal_url(url, prel, pl);
    size_t big = strlen(url) * 2 + 64;
    if (((mode >> 3) & 3) == 3) {
        if (!idemp_pg_uri_ambiguous(url)) {
            /* legitimately shown: what the URL without its password names */
            char *where = malloc(big), *allowed = malloc(strlen(ideal) + 1 + big);
            idemp_pg_where(url, where, big);
            strcpy(allowed, ideal);
            strcat(allowed, " ");
            idemp_pg_where(ideal, allowed + strlen(allowed), big);
            no_leak("idemp_pg_where", where, allowed, secret, url);
            free(allowed);
            free(where);
        }
    } else {
        /* a list is refused as a whole when one of its URLs is (rmq.c) */
        idemp_amqp_url_t u;
        bool ok = true;
        char *copy = strdup(url), *save = NULL;
        for (char *tok = strtok_r(copy, ",", &save); tok && ok; tok = strtok_r(NULL, ",", &save))
            ok = idemp_amqp_url_parse(tok, &u) == IDEM_OK;
        free(copy);
        if (!ok) {
            char *m = mask_with(idemp_mask_unparsed_url, url, big);
            no_leak("idemp_mask_unparsed_url", m, ideal, secret, url);
            free(m);
        }
    }
    free(ideal);
    free(secret);
    free(url);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2 || size > 4096)
        return 0;
    uint8_t mode = data[0];
    size_t outsz = data[1];
    if (mode & 4) {
        check_unencoded(data + 2, size - 2, mode);
        return 0;
    }
    const char *prefix = (mode & 1) ? "" : "amqp://";
    size_t plen = strlen(prefix), n = size - 2;
    char *text = malloc(plen + n + 1);
    memcpy(text, prefix, plen);
    memcpy(text + plen, data + 2, n);
    text[plen + n] = '\0';

    /* any output size, including 0 and 1, must stay within the buffer */
    free(mask_with(idemp_mask_secrets, text, outsz));
    free(mask_with(idemp_mask_line, text, outsz));

    if (strlen(text) == plen + n) { /* the whole input, no NUL inside */
        check_url(text);
        if (mode & 2)
            check_conninfo(text);
    }
    free(text);
    return 0;
}
