/* fault.h - fault seams for crash tests: IDEM_FAULT=POINT[:N] acts the Nth time (default 1st)
 * the process reaches POINT. A testing tool, documented as such. */
#ifndef IDEM_FAULT_H
#define IDEM_FAULT_H

#include <stdbool.h>

/* A crash point: SIGKILLs the process. */
void idemp_fault_point(const char *point);

/* An allocation-failure point: true (once) when reached for the Nth time. */
bool idemp_fault_fail(const char *point);

#endif
