/* log.c - one line per event of note on stderr, text or JSON, secrets masked. */
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include <idem/error.h>
#include <idem/log.h>

#include "mask.h"

static idem_log_level min_level = IDEM_LOG_INFO;
static idem_log_format log_format = IDEM_LOG_TEXT;
static const char *const level_names[] = {"debug", "info", "warn", "error"};

void idem_log_set_level(idem_log_level level)
{
    min_level = level;
}

void idem_log_set_format(idem_log_format format)
{
    log_format = format;
}

int idem_log_parse_level(const char *s, idem_log_level *out)
{
    for (int i = 0; i < 4; i++)
        if (s != NULL && strcmp(s, level_names[i]) == 0) {
            *out = (idem_log_level)i;
            return IDEM_OK;
        }
    return IDEM_ERR_INVALID;
}

int idem_log_parse_format(const char *s, idem_log_format *out)
{
    if (s != NULL && strcmp(s, "text") == 0)
        *out = IDEM_LOG_TEXT;
    else if (s != NULL && strcmp(s, "json") == 0)
        *out = IDEM_LOG_JSON;
    else
        return IDEM_ERR_INVALID;
    return IDEM_OK;
}

/* Length of the valid UTF-8 sequence at s (at most n bytes), 0 if there is none. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        lo = c == 0xE0 ? 0xA0 : 0x80;
        hi = c == 0xED ? 0x9F : 0xBF;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        lo = c == 0xF0 ? 0x90 : 0x80;
        hi = c == 0xF4 ? 0x8F : 0xBF;
    } else
        return 0;
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return len;
}

/* Copies in to out so that a line cannot be forged: control characters and bytes that are not
 * UTF-8 become \xNN; in text, quotes and backslashes are escaped too (JSON escapes its own). */
void idemp_log_escape(const char *in, char *out, size_t sz, bool text)
{
    const unsigned char *s = (const unsigned char *)in;
    size_t n = strlen(in), o = 0;
    for (size_t i = 0; i < n && o + 1 < sz;) {
        size_t len = utf8_len(s + i, n - i);
        if (len == 1 && s[i] >= 0x20 && s[i] != 0x7f) {
            if (text && (s[i] == '"' || s[i] == '\\')) {
                if (o + 3 > sz)
                    break;
                out[o++] = '\\';
            }
            out[o++] = (char)s[i++];
        } else if (len > 1) {
            if (o + len + 1 > sz)
                break;
            memcpy(out + o, s + i, len);
            o += len;
            i += len;
        } else {
            if (o + 5 > sz)
                break;
            o += (size_t)snprintf(out + o, sz - o, "\\x%02X", s[i++]);
        }
    }
    out[o] = '\0';
}

static void timestamp(char *buf, size_t sz)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(buf, sz, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, sz - n, ".%03ldZ", ts.tv_nsec / 1000000);
}

void idem_log(idem_log_level level, const char *component, const char *const *kv, const char *fmt,
              ...)
{
    if (level < min_level)
        return;
    char msg[2048], ts[40];
    va_list ap;
    va_start(ap, fmt);
    char *raw = idemp_vformat(fmt, ap);
    va_end(ap);
    idemp_mask_line(raw ? raw : "(log line lost: out of memory)", msg, sizeof msg);
    free(raw);
    timestamp(ts, sizeof ts);

    bool text = log_format != IDEM_LOG_JSON;
    char safe[4096];
    idemp_log_escape(msg, safe, sizeof safe, text);
    if (!text) {
        json_t *o = json_object();
        json_object_set_new(o, "ts", json_string(ts));
        json_object_set_new(o, "level", json_string(level_names[level]));
        json_object_set_new(o, "component", json_string(component));
        json_object_set_new(o, "msg", json_string(safe));
        for (const char *const *p = kv; p != NULL && p[0] != NULL; p += 2) {
            if (p[1] == NULL)
                continue;
            char val[1024], esc[2048];
            idemp_mask_line(p[1], val, sizeof val);
            idemp_log_escape(val, esc, sizeof esc, false);
            json_object_set_new(o, p[0], json_string(esc));
        }
        char *line = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (line != NULL) {
            fprintf(stderr, "%s\n", line);
            free(line);
        }
        json_decref(o);
    } else {
        char line[8192];
        int n =
            snprintf(line, sizeof line, "%s %-5s %s: %s", ts, level_names[level], component, safe);
        for (const char *const *p = kv; p != NULL && p[0] != NULL && n < (int)sizeof line; p += 2) {
            if (p[1] == NULL)
                continue;
            char val[1024], esc[2048];
            idemp_mask_line(p[1], val, sizeof val);
            idemp_log_escape(val, esc, sizeof esc, true);
            bool quote = strpbrk(esc, " \"=\\") != NULL || *esc == '\0';
            n += snprintf(line + n, sizeof line - n, quote ? " %s=\"%s\"" : " %s=%s", p[0], esc);
        }
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
}
