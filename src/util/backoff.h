/* backoff.h - exponential backoff with a cap. */
#ifndef IDEM_BACKOFF_H
#define IDEM_BACKOFF_H

#include <stdint.h>

/* base * 2^(n-1) for n >= 1, capped at max; 0 for n <= 0. */
int64_t idemp_backoff_delay(int64_t base_ms, int64_t max_ms, int n);

/* A reconnect schedule: next() returns the wait before the next attempt (0 for the first),
 * doubling from base to max; reset() after a success. */
typedef struct idemp_backoff {
    int64_t base_ms, max_ms;
    int failures;
} idemp_backoff_t;

void idemp_backoff_init(idemp_backoff_t *b, int64_t base_ms, int64_t max_ms);
int64_t idemp_backoff_next(idemp_backoff_t *b);
void idemp_backoff_reset(idemp_backoff_t *b);

#endif
