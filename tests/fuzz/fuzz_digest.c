/* fuzz_digest.c - libFuzzer target for the ledger's content digest (src/wire/digest.c:
 * idemp_digest_event), which tells a redelivery (same digest) from an id collision (another).
 *
 * Input: three fields (fuzz_common.h): event type, subscription id, payload JSON; then a byte k
 * (where to cut the type and subscription id, joined, into another pair).
 *
 * Checked beyond memory safety:
 * - the digest is SHA-256 of type, NUL, subscription id, NUL and the payload dumped compact with
 *   sorted keys, whether the form fits the stack buffer or is streamed (past 4 KiB): computed
 *   here independently and compared;
 * - it is deterministic, and the same for the payload re-read from an indented dump with its
 *   object keys inserted in reverse order (spacing and key order do not count);
 * - the fields' boundaries count: the type and subscription id cut at another place (("ab", "c")
 *   against ("a", "bc")) give another digest, and so does another payload. */
#include <jansson.h>
#include <openssl/evp.h>

#include "digest.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FLAGS (JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY)

/* type \0 sub \0 canonical(payload), hashed in one piece, to hex */
static void reference(const char *type, const char *sub, const json_t *payload, char hex[65])
{
    char *body = json_dumps(payload, FLAGS);
    FZ_CHECK(body != NULL, "dump failed");
    size_t tl = strlen(type) + 1, sl = strlen(sub) + 1, bl = strlen(body);
    unsigned char *buf = malloc(tl + sl + bl + 1);
    memcpy(buf, type, tl);
    memcpy(buf + tl, sub, sl);
    memcpy(buf + tl + sl, body, bl);
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    FZ_CHECK(EVP_Digest(buf, tl + sl + bl, md, &mdlen, EVP_sha256(), NULL) == 1 && mdlen == 32,
             "EVP_Digest failed");
    for (unsigned int i = 0; i < mdlen; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
    free(buf);
    free(body);
}

/* A copy of v whose objects have their keys inserted in reverse order of v's. */
static json_t *reversed(const json_t *v)
{
    if (json_is_array(v)) {
        json_t *a = json_array();
        for (size_t i = 0; i < json_array_size(v); i++)
            json_array_append_new(a, reversed(json_array_get(v, i)));
        return a;
    }
    if (!json_is_object(v))
        return json_deep_copy(v);
    size_t n = json_object_size(v), i = 0;
    const char **keys = malloc((n ? n : 1) * sizeof *keys);
    const char *k;
    json_t *x;
    json_object_foreach((json_t *)v, k, x) keys[i++] = k;
    json_t *o = json_object();
    while (i > 0) {
        i--;
        json_object_set_new(o, keys[i], reversed(json_object_get(v, keys[i])));
    }
    free(keys);
    return o;
}

static void digest(const char *type, const char *sub, const json_t *payload, char hex[65])
{
    FZ_CHECK(idemp_digest_event(type, sub, payload, hex), "idemp_digest_event failed");
    FZ_CHECK(strlen(hex) == 64, "digest '%s' is not 64 hex digits", hex);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_t f = {data, size};
    size_t tl, sl, pl;
    const uint8_t *t = fz_field(&f, &tl), *s = fz_field(&f, &sl), *p = fz_field(&f, &pl);
    uint8_t k = fz_u8(&f);
    /* the envelope refuses a NUL in the type; the subscription id is canonical text */
    if (memchr(t, '\0', tl) != NULL || memchr(s, '\0', sl) != NULL)
        return 0;
    json_t *payload = json_loadb((const char *)p, pl, JSON_DECODE_ANY, NULL);
    if (payload == NULL)
        return 0;
    char *type = fz_dup(t, tl, 1), *sub = fz_dup(s, sl, 1);
    char got[65], again[65], want[65], other[65];

    digest(type, sub, payload, got);
    reference(type, sub, payload, want);
    FZ_CHECK(strcmp(got, want) == 0, "digest %s, want %s (type '%s', sub '%s')", got, want, type,
             sub);
    digest(type, sub, payload, again);
    FZ_CHECK(strcmp(got, again) == 0, "not deterministic: %s then %s", got, again);

    /* the same content, spaced and ordered otherwise */
    json_t *rev = reversed(payload);
    char *pretty = json_dumps(rev, JSON_INDENT(3) | JSON_ENCODE_ANY | JSON_ESCAPE_SLASH);
    json_t *back = pretty ? json_loads(pretty, JSON_DECODE_ANY, NULL) : NULL;
    FZ_CHECK(back != NULL, "an indented dump does not load again: %s", pretty ? pretty : "(null)");
    digest(type, sub, back, again);
    FZ_CHECK(strcmp(got, again) == 0, "key order or spacing changed the digest");

    /* the boundary between type and subscription id moved */
    size_t cut = tl + sl == 0 ? 0 : k % (tl + sl + 1);
    if (cut != tl) {
        char *joined = malloc(tl + sl + 1);
        memcpy(joined, t, tl);
        memcpy(joined + tl, s, sl);
        joined[tl + sl] = '\0';
        char *t2 = fz_dup((const uint8_t *)joined, cut, 1);
        digest(t2, joined + cut, payload, other);
        FZ_CHECK(strcmp(got, other) != 0, "('%s', '%s') and ('%s', '%s') collide", type, sub, t2,
                 joined + cut);
        free(t2);
        free(joined);
    }
    /* the subscription id moved into the payload (when it is text JSON can hold) */
    json_t *s_json = json_string(sub);
    if (s_json != NULL) {
        json_t *wrapped = json_object();
        json_object_set(wrapped, "p", payload);
        json_object_set_new(wrapped, "s", s_json);
        digest(type, "", wrapped, other);
        FZ_CHECK(strcmp(got, other) != 0, "payload moved into another field collides");
        json_decref(wrapped);
    }

    json_decref(back);
    free(pretty);
    json_decref(rev);
    json_decref(payload);
    free(type);
    free(sub);
    return 0;
}
