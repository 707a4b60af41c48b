/* backoff.c - exponential backoff with a cap. */
#include "backoff.h"

int64_t idemp_backoff_delay(int64_t base_ms, int64_t max_ms, int n)
{
    if (n <= 0)
        return 0;
    int64_t d = base_ms;
    for (int i = 1; i < n && d < max_ms; i++)
        d = d > max_ms / 2 ? max_ms : d * 2;
    return d < max_ms ? d : max_ms;
}

void idemp_backoff_init(idemp_backoff_t *b, int64_t base_ms, int64_t max_ms)
{
    b->base_ms = base_ms;
    b->max_ms = max_ms;
    b->failures = 0;
}

int64_t idemp_backoff_next(idemp_backoff_t *b)
{
    return idemp_backoff_delay(b->base_ms, b->max_ms, b->failures++);
}

void idemp_backoff_reset(idemp_backoff_t *b)
{
    b->failures = 0;
}
