/* host.h - what a host name or address says about where a connection goes. */
#ifndef IDEM_HOST_H
#define IDEM_HOST_H

#include <stdbool.h>

/* Is host this machine's own loopback: "localhost" (or a name under .localhost), 127.0.0.0/8,
 * ::1 (bracketed or not, also as ::ffff:127.x.y.z), a Unix socket directory (libpq's host
 * starting with '/') or empty (libpq's default, the local socket)? Any other name may resolve
 * to another machine: false. */
bool idemp_host_loopback(const char *host);

#endif
