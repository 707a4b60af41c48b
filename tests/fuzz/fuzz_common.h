/* fuzz_common.h - small helpers shared by the libFuzzer targets: a reader that splits the fuzz
 * input into length-prefixed fields, and an abort that prints why. */
#ifndef IDEM_FUZZ_COMMON_H
#define IDEM_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fz {
    const uint8_t *p;
    size_t n;
} fz_t;

static inline uint8_t fz_u8(fz_t *f)
{
    if (f->n == 0)
        return 0;
    uint8_t v = f->p[0];
    f->p++;
    f->n--;
    return v;
}

static inline uint64_t fz_u64(fz_t *f)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)fz_u8(f) << (8 * i);
    return v;
}

/* A field: 2-byte little-endian length, then that many bytes (fewer when the input ends). */
static inline const uint8_t *fz_field(fz_t *f, size_t *len)
{
    size_t want = fz_u8(f);
    want |= (size_t)fz_u8(f) << 8;
    if (want > f->n)
        want = f->n;
    const uint8_t *p = f->p;
    f->p += want;
    f->n -= want;
    *len = want;
    return p;
}

/* A heap copy of exactly len bytes (so that ASan sees a read past the field), or of len + 1
 * with a NUL when nul is set. Never NULL for len 0: malloc(1). */
static inline char *fz_dup(const uint8_t *p, size_t len, int nul)
{
    char *s = malloc(len + (nul ? 1 : 0) + (len == 0 && !nul ? 1 : 0));
    if (s == NULL)
        abort();
    if (len)
        memcpy(s, p, len);
    if (nul)
        s[len] = '\0';
    return s;
}

#define FZ_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FUZZ CHECK FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);           \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif
