/* pg_array.c - array literals for uuid[], text[] and bigint[] parameters. */
#include <stdlib.h>
#include <string.h>

#include "pg.h"

/* ---- array literals ------------------------------------------------------------------------ */

void idemp_pgarray_init(idemp_pgarray_t *a)
{
    memset(a, 0, sizeof *a);
}

static bool reserve(idemp_pgarray_t *a, size_t more)
{
    size_t need = a->len + more + 3; /* the braces and the NUL */
    if (need <= a->cap)
        return true;
    size_t cap = a->cap ? a->cap : 1024;
    while (cap < need)
        cap *= 2;
    char *b = realloc(a->buf, cap);
    if (b == NULL) {
        a->failed = true;
        return false;
    }
    if (a->buf == NULL)
        b[0] = '{';
    a->buf = b;
    a->cap = cap;
    if (a->len == 0)
        a->len = 1;
    return true;
}

void idemp_pgarray_add(idemp_pgarray_t *a, const char *elem)
{
    if (a->failed)
        return;
    size_t l = elem ? strlen(elem) : 0;
    if (!reserve(a, l * 2 + 8))
        return;
    char *p = a->buf + a->len;
    if (a->n > 0)
        *p++ = ',';
    if (elem == NULL) {
        memcpy(p, "NULL", 4);
        p += 4;
    } else {
        *p++ = '"';
        for (const char *s = elem; *s; s++) {
            if (*s == '"' || *s == '\\')
                *p++ = '\\';
            *p++ = *s;
        }
        *p++ = '"';
    }
    a->len = (size_t)(p - a->buf);
    a->n++;
}

const char *idemp_pgarray_str(idemp_pgarray_t *a)
{
    if (a->failed || !reserve(a, 0))
        return NULL;
    a->buf[a->len] = '}';
    a->buf[a->len + 1] = '\0';
    return a->buf;
}

void idemp_pgarray_free(idemp_pgarray_t *a)
{
    free(a->buf);
    idemp_pgarray_init(a);
}
