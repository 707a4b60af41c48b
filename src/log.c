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

    if (log_format == IDEM_LOG_JSON) {
        json_t *o = json_object();
        json_object_set_new(o, "ts", json_string(ts));
        json_object_set_new(o, "level", json_string(level_names[level]));
        json_object_set_new(o, "component", json_string(component));
        json_object_set_new(o, "msg", json_string(msg));
        for (const char *const *p = kv; p != NULL && p[0] != NULL; p += 2) {
            if (p[1] == NULL)
                continue;
            char val[1024];
            idemp_mask_line(p[1], val, sizeof val);
            json_object_set_new(o, p[0], json_string(val));
        }
        char *line = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (line != NULL) {
            fprintf(stderr, "%s\n", line);
            free(line);
        }
        json_decref(o);
    } else {
        char line[4096];
        int n =
            snprintf(line, sizeof line, "%s %-5s %s: %s", ts, level_names[level], component, msg);
        for (const char *const *p = kv; p != NULL && p[0] != NULL && n < (int)sizeof line; p += 2) {
            if (p[1] == NULL)
                continue;
            char val[1024];
            idemp_mask_line(p[1], val, sizeof val);
            bool quote = strpbrk(val, " \"=") != NULL || *val == '\0';
            n += snprintf(line + n, sizeof line - n, quote ? " %s=\"%s\"" : " %s=%s", p[0], val);
        }
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
}
