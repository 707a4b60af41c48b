/* mask.h - hiding passwords in URLs and conninfo strings. */
#ifndef IDEM_MASK_H
#define IDEM_MASK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

/* Copies in to out (NUL-terminated, truncated to outsz) with every URL password
 * ("scheme://user:SECRET@") and every conninfo "password=SECRET" replaced by "***". */
void idemp_mask_secrets(const char *in, char *out, size_t outsz);

/* A URL (or a comma-separated list of them) that did not parse, for an error message: whatever it
 * holds between its scheme's "://" and its last '@' (user names and passwords in any form, with
 * "://", ',' or '@' in them) becomes "***", so the scheme and what follows the last '@' remain.
 * Text without '@' holds no userinfo and is copied as it is. */
void idemp_mask_unparsed_url(const char *in, char *out, size_t outsz);

/* vsnprintf into a new malloc'd string (NULL on failure). */
char *idemp_vformat(const char *fmt, va_list ap);

/* One log or error line: newlines and tabs become spaces (a trailing one is dropped), secrets
 * are masked over the whole input, then the result is cut to outsz. */
void idemp_mask_line(const char *in, char *out, size_t outsz);

/* Copies in to out (truncated to sz) so that it cannot forge a log line: control characters and
 * bytes that are not UTF-8 become \xNN; with text, quotes and backslashes are escaped too. */
void idemp_log_escape(const char *in, char *out, size_t sz, bool text);

#endif
