/* digest.c - the content digest of an event (see digest.h). */
#include <string.h>

#include <openssl/evp.h>

#include "digest.h"

static int feed(const char *buf, size_t len, void *ctx)
{
    return EVP_DigestUpdate(ctx, buf, len) == 1 ? 0 : -1;
}

bool idemp_digest_event(const char *event_type, const char *subscription_id, const json_t *payload,
                        char hex[IDEMP_DIGEST_HEX])
{
    hex[0] = '\0';
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    bool ok = ctx != NULL && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 &&
              EVP_DigestUpdate(ctx, event_type, strlen(event_type) + 1) == 1 &&
              EVP_DigestUpdate(ctx, subscription_id, strlen(subscription_id) + 1) == 1 &&
              json_dump_callback(payload, feed, ctx,
                                 JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY) == 0 &&
              EVP_DigestFinal_ex(ctx, md, &mdlen) == 1 && mdlen == 32;
    EVP_MD_CTX_free(ctx);
    if (!ok)
        return false;
    static const char digits[] = "0123456789abcdef";
    for (unsigned int i = 0; i < mdlen; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[2 * mdlen] = '\0';
    return true;
}
