/* host.c - what a host name or address says about where a connection goes. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "host.h"

bool idemp_host_loopback(const char *host)
{
    if (host == NULL || host[0] == '\0' || host[0] == '/')
        return true;
    char h[256];
    size_t n = strlen(host);
    if (host[0] == '[' && n >= 2 && host[n - 1] == ']') {
        host++;
        n -= 2;
    }
    if (n >= sizeof h)
        return false;
    memcpy(h, host, n);
    h[n] = '\0';
    static const char suffix[] = ".localhost";
    size_t sl = sizeof suffix - 1;
    if (strcasecmp(h, "localhost") == 0 || (n > sl && strcasecmp(h + n - sl, suffix) == 0))
        return true;
    struct in_addr a4;
    if (inet_pton(AF_INET, h, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    struct in6_addr a6;
    if (inet_pton(AF_INET6, h, &a6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
    return false;
}
