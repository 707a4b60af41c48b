/* notify.h - systemd's notification protocol (sd_notify(3)) without libsystemd: state lines
 * such as "READY=1", "STOPPING=1", "STATUS=..." sent as one datagram to $NOTIFY_SOCKET. */
#ifndef IDEM_NOTIFY_H
#define IDEM_NOTIFY_H

#include <stdbool.h>
#include <stddef.h>

/* Sends state (newline-separated "KEY=VALUE" lines) to $NOTIFY_SOCKET: a socket path, or an
 * abstract socket name when it starts with '@'. 0 when sent or when there is no $NOTIFY_SOCKET
 * (not run by systemd); -1 when it could not be sent (logged at debug level). */
int idemp_notify(const char *state);
/* The same with a printf format ("STATUS=%s"). */
int idemp_notifyf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A daemon's readiness and status as its health changes: READY=1 (with STATUS=status) the first
 * time it is serving (*ready is then set), later STATUS=status whenever it differs from told
 * (what was told last, a buffer of toldsz bytes). */
void idemp_notify_status(bool *ready, char *told, size_t toldsz, bool serving, const char *status);

#endif
