/* duration.c - "90s", "15m", "7d", "200ms". */
#include <ctype.h>
#include <stdint.h>
#include <string.h>

#include <idem/duration.h>
#include <idem/error.h>

int idem_duration_parse(const char *s, bool allow_ms, int64_t *out_ms)
{
    if (s == NULL || !isdigit((unsigned char)*s))
        return IDEM_ERR_INVALID;
    int64_t n = 0;
    while (isdigit((unsigned char)*s)) {
        if (n > (INT64_MAX - (*s - '0')) / 10)
            return IDEM_ERR_INVALID;
        n = n * 10 + (*s++ - '0');
    }
    int64_t mult;
    if (allow_ms && strcmp(s, "ms") == 0)
        mult = 1;
    else if (strcmp(s, "s") == 0)
        mult = 1000;
    else if (strcmp(s, "m") == 0)
        mult = 60 * 1000;
    else if (strcmp(s, "h") == 0)
        mult = 3600 * 1000;
    else if (strcmp(s, "d") == 0)
        mult = 86400 * 1000;
    else
        return IDEM_ERR_INVALID;
    if (n > INT64_MAX / mult)
        return IDEM_ERR_INVALID;
    *out_ms = n * mult;
    return IDEM_OK;
}
