/* idem/duration.h - durations as the CLI spells them ("90s", "15m", "7d", "200ms"). */
#ifndef IDEM_DURATION_H
#define IDEM_DURATION_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Parses an integer followed by a unit s, m, h or d (and ms when allow_ms) into milliseconds.
 * A missing unit, a sign, an empty number or an overflow is IDEM_ERR_INVALID. */
int idem_duration_parse(const char *s, bool allow_ms, int64_t *out_ms);

#ifdef __cplusplus
}
#endif
#endif
