/* uuid.c - accepting UUIDs in every form PostgreSQL's uuid type accepts. */
#include <ctype.h>
#include <string.h>

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
