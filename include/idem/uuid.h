/* idem/uuid.h - event and subscription ids. */
#ifndef IDEM_UUID_PUBLIC_H
#define IDEM_UUID_PUBLIC_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes s in lowercase canonical form (36 chars + NUL) to out if s is a UUID in any form
 * PostgreSQL's uuid type accepts (braces, upper case, hyphens after any group of four digits);
 * returns false otherwise. */
bool idem_uuid_normalize(const char *s, char out[37]);

#ifdef __cplusplus
}
#endif
#endif
