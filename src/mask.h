/* mask.h - hiding passwords in URLs and conninfo strings. */
#ifndef IDEM_MASK_H
#define IDEM_MASK_H

#include <stddef.h>

/* Copies in to out (NUL-terminated, truncated to outsz) with every URL password
 * ("scheme://user:SECRET@") and every conninfo "password=SECRET" replaced by "***". */
void idemp_mask_secrets(const char *in, char *out, size_t outsz);

/* "host:port" of a libpq conninfo/URI or an AMQP URL, for messages; defaults filled in. */
void idemp_pg_where(const char *conninfo, char *out, size_t outsz);

#endif
