/* error.c - status strings and the error object. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idem/error.h>

#include "mask.h"

static const char *const status_text[] = {
    "success",                               /* IDEM_OK */
    "out of memory",                         /* IDEM_ERR_NOMEM */
    "invalid argument",                      /* IDEM_ERR_INVALID */
    "cannot connect to PostgreSQL",          /* IDEM_ERR_PG_CONNECT */
    "PostgreSQL statement failed",           /* IDEM_ERR_PG_QUERY */
    "PostgreSQL connection lost",            /* IDEM_ERR_PG_LOST */
    "cannot connect to RabbitMQ",            /* IDEM_ERR_AMQP_CONNECT */
    "RabbitMQ operation refused",            /* IDEM_ERR_AMQP */
    "RabbitMQ connection lost",              /* IDEM_ERR_AMQP_LOST */
    "timed out",                             /* IDEM_ERR_TIMEOUT */
    "not found",                             /* IDEM_ERR_NOT_FOUND */
    "refused by a safety rule",              /* IDEM_ERR_REFUSED */
    "another runner holds the lock",         /* IDEM_ERR_BUSY */
    "I/O error",                             /* IDEM_ERR_IO */
    "malformed input",                       /* IDEM_ERR_PARSE */
    "interrupted",                           /* IDEM_ERR_INTERRUPTED */
    "transaction rolled back by the server", /* IDEM_ERR_PG_ROLLBACK */
    "message cannot be encoded for AMQP",    /* IDEM_ERR_UNENCODABLE */
};

_Static_assert(sizeof status_text / sizeof status_text[0] == (size_t)(-IDEM_STATUS_MIN) + 1,
               "every idem_status needs a text");

const char *idem_strerror(int status)
{
    if (status > 0 || status < IDEM_STATUS_MIN)
        return "unknown status";
    return status_text[-status];
}

int idem_error_set(idem_error_t *err, int code, const char *fmt, ...)
{
    if (err == NULL || err->code != 0)
        return code;
    va_list ap;
    va_start(ap, fmt);
    char *raw = idemp_vformat(fmt, ap);
    va_end(ap);
    /* mask the whole text before it is cut to size, so a cut cannot expose a password */
    idemp_mask_line(raw ? raw : "out of memory", err->text, sizeof err->text);
    free(raw);
    err->code = code;
    return code;
}

void idem_error_clear(idem_error_t *err)
{
    if (err != NULL)
        memset(err, 0, sizeof *err);
}
