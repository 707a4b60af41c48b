/* fault.h - fault seams for crash tests: IDEM_FAULT=POINT[:N] SIGKILLs the process the Nth time
 * (default 1st) it reaches POINT. A testing tool, documented as such. */
#ifndef IDEM_FAULT_H
#define IDEM_FAULT_H

void idemp_fault_point(const char *point);

#endif
