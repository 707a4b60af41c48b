/* mask.c - hiding passwords in URLs and conninfo strings. */
#include <ctype.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "mask.h"

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

void idemp_mask_secrets(const char *in, char *out, size_t outsz)
{
    size_t o = 0;
    if (outsz == 0)
        return;
    for (size_t i = 0; in[i];) {
        /* URL userinfo: scheme://user:secret@ */
        if (in[i] == ':' && in[i + 1] == '/' && in[i + 2] == '/') {
            puts_n(out, outsz, &o, "://");
            i += 3;
            /* the userinfo ends at the last '@' of the authority, as URL parsers read it */
            size_t j = i, at = 0;
            bool has_at = false;
            while (in[j] && in[j] != '/' && !isspace((unsigned char)in[j])) {
                if (in[j] == '@') {
                    at = j;
                    has_at = true;
                }
                j++;
            }
            if (has_at) {
                const char *colon = memchr(in + i, ':', at - i);
                if (colon != NULL) {
                    while (in + i < colon)
                        put(out, outsz, &o, in[i++]);
                    puts_n(out, outsz, &o, ":***");
                    i = at;
                }
            }
            continue;
        }
        /* conninfo keyword: password=secret or password='se cret' */
        if ((i == 0 || !isalnum((unsigned char)in[i - 1])) && strncmp(in + i, "password", 8) == 0) {
            size_t j = i + 8;
            while (in[j] == ' ')
                j++;
            if (in[j] == '=') {
                j++;
                while (in[j] == ' ')
                    j++;
                puts_n(out, outsz, &o, "password=***");
                if (in[j] == '\'') {
                    j++;
                    while (in[j] && in[j] != '\'') {
                        if (in[j] == '\\' && in[j + 1])
                            j++;
                        j++;
                    }
                    if (in[j] == '\'')
                        j++;
                } else {
                    while (in[j] && !isspace((unsigned char)in[j]) && in[j] != '&')
                        j++;
                }
                i = j;
                continue;
            }
        }
        put(out, outsz, &o, in[i++]);
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
