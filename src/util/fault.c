/* fault.c - fault seams for crash tests. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idem/log.h>

#include "fault.h"

/* True the Nth time the named point is reached (IDEM_FAULT=POINT[:N]). */
static bool reached(const char *point, int *hits)
{
    const char *spec = getenv("IDEM_FAULT");
    if (spec == NULL || *spec == '\0')
        return false;
    size_t n = strlen(point);
    if (strncmp(spec, point, n) != 0 || (spec[n] != '\0' && spec[n] != ':'))
        return false;
    long want = spec[n] == ':' ? strtol(spec + n + 1, NULL, 10) : 1;
    return ++*hits == (want > 0 ? want : 1);
}

void idemp_fault_point(const char *point)
{
    static int hits;
    if (!reached(point, &hits))
        return;
    const char *kv[] = {"point", point, NULL};
    idem_log(IDEM_LOG_WARN, "fault", kv, "IDEM_FAULT reached, killing the process");
    kill(getpid(), SIGKILL);
    _exit(137);
}

bool idemp_fault_fail(const char *point)
{
    static int hits;
    if (!reached(point, &hits))
        return false;
    const char *kv[] = {"point", point, NULL};
    idem_log(IDEM_LOG_WARN, "fault", kv, "IDEM_FAULT reached, failing an allocation");
    return true;
}
