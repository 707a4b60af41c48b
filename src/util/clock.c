/* clock.c - monotonic and wall time in milliseconds, interruptible sleep. */
#include <time.h>

#include "clock.h"

static int64_t clock_ms(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t idemp_now_ms(void)
{
    return clock_ms(CLOCK_MONOTONIC);
}

int64_t idemp_wall_ms(void)
{
    return clock_ms(CLOCK_REALTIME);
}

int64_t idemp_wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void idemp_sleep_ms(int64_t ms, volatile sig_atomic_t *stop)
{
    int64_t end = idemp_now_ms() + ms;
    for (;;) {
        if (stop != NULL && *stop)
            return;
        int64_t left = end - idemp_now_ms();
        if (left <= 0)
            return;
        if (left > 100)
            left = 100;
        struct timespec ts = {left / 1000, (left % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}
