/* clock.h - monotonic and wall time in milliseconds, interruptible sleep. */
#ifndef IDEM_CLOCK_H
#define IDEM_CLOCK_H

#include <signal.h>
#include <stdint.h>

int64_t idemp_now_ms(void);  /* CLOCK_MONOTONIC */
int64_t idemp_wall_ms(void); /* CLOCK_REALTIME */
int64_t idemp_wall_us(void); /* CLOCK_REALTIME, microseconds */
/* Sleeps up to ms, in slices, returning early once *stop is set (stop may be NULL). */
void idemp_sleep_ms(int64_t ms, volatile sig_atomic_t *stop);

#endif
