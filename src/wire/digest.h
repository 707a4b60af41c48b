/* digest.h - the digest of an event's content that the dedup ledger keeps beside its id
 * (consumed_events.digest): a delivery whose id is in the ledger with another digest is a
 * collision (dead-lettered as conflict), not a duplicate. Pure logic (jansson, OpenSSL's SHA-256),
 * tested without servers. */
#ifndef IDEM_DIGEST_H
#define IDEM_DIGEST_H

#include <stdbool.h>

#include <jansson.h>

#define IDEMP_DIGEST_HEX 65 /* 64 hex digits of SHA-256 and the NUL */

/* SHA-256 of the canonical form of what a handler is given: the event type, a NUL byte, the
 * subscription id (lowercase canonical, or "" when none), a NUL byte, and the payload as compact
 * JSON with every object's keys sorted (jansson's JSON_COMPACT | JSON_SORT_KEYS, UTF-8 as is).
 * The same content in any spacing, key order or escaping gives the same digest. Written to hex in
 * lowercase; false (hex = "") on allocation failure. The type holds no NUL (the envelope refuses
 * one), so the form is unambiguous. */
bool idemp_digest_event(const char *event_type, const char *subscription_id, const json_t *payload,
                        char hex[IDEMP_DIGEST_HEX]);

#endif
