/* uuid.c - accepting UUIDs in every form PostgreSQL's uuid type accepts, and making random ones. */
#include <ctype.h>
#include <errno.h>
#include <string.h>
#include <sys/random.h>

#include <idem/uuid.h>

#include "uuid.h"

bool idemp_uuid_normalize(const char *s, size_t len, char out[37])
{
    static const char hex[] = "0123456789abcdef";
    size_t i = 0, end = len;
    bool braces = len > 0 && s[0] == '{';
    if (braces) {
        if (len < 2 || s[len - 1] != '}')
            return false;
        i = 1;
        end = len - 1;
    }
    int ndig = 0, o = 0;
    /* PostgreSQL: 32 hex digits, an optional hyphen after each group of four digits */
    while (i < end) {
        char ch = s[i];
        if (ch == '-') {
            if (ndig == 0 || ndig % 4 != 0 || ndig == 32 || (i > 0 && s[i - 1] == '-'))
                return false;
            i++;
            continue;
        }
        if (!isxdigit((unsigned char)ch) || ndig == 32)
            return false;
        int v = isdigit((unsigned char)ch) ? ch - '0' : (tolower((unsigned char)ch) - 'a' + 10);
        if (ndig == 8 || ndig == 12 || ndig == 16 || ndig == 20)
            out[o++] = '-';
        out[o++] = hex[v];
        ndig++;
        i++;
    }
    if (ndig != 32 || (end > 0 && s[end - 1] == '-'))
        return false;
    out[o] = '\0';
    return true;
}

bool idem_uuid_normalize(const char *s, char out[37])
{
    return s != NULL && idemp_uuid_normalize(s, strlen(s), out);
}

/* A random (version 4) UUID in out[37]; false when the system has no randomness to give. */
bool idemp_uuid_random(char out[37])
{
    unsigned char b[16];
    size_t got = 0;
    while (got < sizeof b) {
        ssize_t r = getrandom(b + got, sizeof b - got, 0);
        if (r < 0 && errno != EINTR)
            return false;
        if (r > 0)
            got += (size_t)r;
    }
    b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
    b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            out[o++] = '-';
        out[o++] = hex[b[i] >> 4];
        out[o++] = hex[b[i] & 15];
    }
    out[o] = '\0';
    return true;
}
