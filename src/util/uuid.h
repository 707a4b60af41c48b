/* uuid.h - accepting UUIDs in every form PostgreSQL's uuid type accepts. */
#ifndef IDEM_UUID_H
#define IDEM_UUID_H

#include <stdbool.h>
#include <stddef.h>

/* Normalises s (len bytes, not necessarily NUL-terminated) to lowercase canonical form
 * (8-4-4-4-12) in out[37]. Accepts what PostgreSQL accepts: optional braces, hyphens after any
 * group of four hex digits, upper or lower case. false if s is not a UUID. */
bool idemp_uuid_normalize(const char *s, size_t len, char out[37]);
/* A random (version 4) UUID in out[37]; false when the system has no randomness to give. */
bool idemp_uuid_random(char out[37]);

#endif
