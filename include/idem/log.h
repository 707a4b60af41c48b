/* idem/log.h - process-wide logging to stderr, one line per event of note. */
#ifndef IDEM_LOG_H
#define IDEM_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { IDEM_LOG_DEBUG = 0, IDEM_LOG_INFO, IDEM_LOG_WARN, IDEM_LOG_ERROR } idem_log_level;
typedef enum { IDEM_LOG_TEXT = 0, IDEM_LOG_JSON } idem_log_format;

void idem_log_set_level(idem_log_level level);
void idem_log_set_format(idem_log_format format);
/* Parses "debug|info|warn|error" / "text|json"; 0 or IDEM_ERR_INVALID. */
int idem_log_parse_level(const char *s, idem_log_level *out);
int idem_log_parse_format(const char *s, idem_log_format *out);

/* Logs one line. kv is NULL or a NULL-terminated list of key, value strings (NULL values are
 * skipped). Passwords in URLs and conninfo strings in the message are masked. */
void idem_log(idem_log_level level, const char *component, const char *const *kv, const char *fmt,
              ...) __attribute__((format(printf, 4, 5)));

#ifdef __cplusplus
}
#endif
#endif
