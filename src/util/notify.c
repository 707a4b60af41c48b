/* notify.c - systemd's notification protocol, the part a Type=notify service needs.
 *
 * The protocol (sd_notify(3), "Notification socket" in systemd's documentation): the service
 * manager passes a unix datagram socket in $NOTIFY_SOCKET, a file system path or, with a leading
 * '@', a name in the abstract namespace; each datagram is a set of newline-separated assignments
 * (READY=1, RELOADING=1, STOPPING=1, STATUS=free text). Sending is best effort: a service that
 * cannot notify goes on running (systemd then times out its start, which says why). */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <idem/log.h>

#include "notify.h"

int idemp_notify(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (path == NULL || path[0] == '\0')
        return 0;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t len = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || len > sizeof sa.sun_path ||
        (path[0] == '/' && len == sizeof sa.sun_path)) {
        idem_log(IDEM_LOG_DEBUG, "notify", NULL,
                 "NOTIFY_SOCKET is neither an absolute path nor an abstract name: not notified");
        return -1;
    }
    memcpy(sa.sun_path, path, len);
    if (path[0] == '@')
        sa.sun_path[0] = '\0'; /* the abstract namespace: no terminating NUL counted */
    socklen_t salen =
        (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + (path[0] == '/' ? 1 : 0));
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        idem_log(IDEM_LOG_DEBUG, "notify", NULL, "cannot notify systemd: socket: %s",
                 strerror(errno));
        return -1;
    }
    ssize_t n;
    do
        n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, salen);
    while (n < 0 && errno == EINTR);
    int saved = errno;
    close(fd);
    if (n < 0) {
        idem_log(IDEM_LOG_DEBUG, "notify", NULL, "cannot notify systemd: %s", strerror(saved));
        return -1;
    }
    return 0;
}

int idemp_notifyf(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return idemp_notify(buf);
}

void idemp_notify_status(bool *ready, char *told, size_t toldsz, bool serving, const char *status)
{
    if (!*ready && serving) {
        *ready = true;
        idemp_notifyf("READY=1\nSTATUS=%s", status);
    } else if (*ready && strcmp(status, told) != 0) {
        idemp_notifyf("STATUS=%s", status);
    } else {
        return;
    }
    snprintf(told, toldsz, "%s", status);
}
