/* digest.c - the content digest of an event (see digest.h). */
#include <pthread.h>
#include <string.h>

#include <openssl/evp.h>

#include "digest.h"

#define FLAGS (JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY)
/* Canonical forms up to this size are hashed in one call, from the stack. */
#define INLINE_MAX 4096

/* OpenSSL 3 looks SHA-256 up again on every EVP_sha256() use; fetched once, it costs half. */
static EVP_MD *fetched;
static pthread_once_t fetch_once = PTHREAD_ONCE_INIT;

static void fetch(void)
{
    fetched = EVP_MD_fetch(NULL, "SHA256", NULL);
}

static const EVP_MD *sha256(void)
{
    pthread_once(&fetch_once, fetch);
    return fetched != NULL ? fetched : EVP_sha256();
}

static int feed(const char *buf, size_t len, void *ctx)
{
    return EVP_DigestUpdate(ctx, buf, len) == 1 ? 0 : -1;
}

/* A canonical form too large for the stack, streamed into the hash as it is written. */
static bool streamed(const char *type, const char *sub, const json_t *payload, unsigned char *md,
                     unsigned int *mdlen)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    bool ok = ctx != NULL && EVP_DigestInit_ex(ctx, sha256(), NULL) == 1 &&
              EVP_DigestUpdate(ctx, type, strlen(type) + 1) == 1 &&
              EVP_DigestUpdate(ctx, sub, strlen(sub) + 1) == 1 &&
              json_dump_callback(payload, feed, ctx, FLAGS) == 0 &&
              EVP_DigestFinal_ex(ctx, md, mdlen) == 1;
    EVP_MD_CTX_free(ctx);
    return ok;
}

bool idemp_digest_event(const char *event_type, const char *subscription_id, const json_t *payload,
                        char hex[IDEMP_DIGEST_HEX])
{
    hex[0] = '\0';
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    char buf[INLINE_MAX];
    size_t tl = strlen(event_type) + 1, sl = strlen(subscription_id) + 1, pl = 0;
    bool ok;
    if (tl + sl < sizeof buf) {
        memcpy(buf, event_type, tl);
        memcpy(buf + tl, subscription_id, sl);
        pl = json_dumpb(payload, buf + tl + sl, sizeof buf - tl - sl, FLAGS);
    }
    if (pl > 0 && tl + sl + pl <= sizeof buf)
        ok = EVP_Digest(buf, tl + sl + pl, md, &mdlen, sha256(), NULL) == 1;
    else
        ok = streamed(event_type, subscription_id, payload, md, &mdlen);
    if (!ok || mdlen != 32)
        return false;
    static const char digits[] = "0123456789abcdef";
    for (unsigned int i = 0; i < mdlen; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[2 * mdlen] = '\0';
    return true;
}
