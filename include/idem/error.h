/* idem/error.h - status codes and the optional error object.
 *
 * Every idem function that can fail returns an int: 0 (IDEM_OK) on success or a negative
 * idem_status. Functions returning pointers return NULL on failure. Detail travels in an
 * optional, caller-owned idem_error_t; NULL is accepted everywhere; the first error wins. */
#ifndef IDEM_ERROR_H
#define IDEM_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum idem_status {
    IDEM_OK = 0,
    IDEM_ERR_NOMEM = -1,        /* allocation failed */
    IDEM_ERR_INVALID = -2,      /* invalid argument or configuration */
    IDEM_ERR_PG_CONNECT = -3,   /* cannot connect to PostgreSQL */
    IDEM_ERR_PG_QUERY = -4,     /* PostgreSQL refused a statement (see sqlstate) */
    IDEM_ERR_PG_LOST = -5,      /* PostgreSQL connection lost; outcome of the statement unknown */
    IDEM_ERR_AMQP_CONNECT = -6, /* cannot connect to RabbitMQ */
    IDEM_ERR_AMQP = -7,         /* RabbitMQ refused an operation (channel or connection closed) */
    IDEM_ERR_AMQP_LOST = -8,    /* RabbitMQ connection lost */
    IDEM_ERR_TIMEOUT = -9,      /* a wait ran out */
    IDEM_ERR_NOT_FOUND = -10,   /* the named thing does not exist */
    IDEM_ERR_REFUSED = -11,     /* refused by a safety rule */
    IDEM_ERR_BUSY = -12,        /* another runner holds the lock */
    IDEM_ERR_IO = -13,          /* file or socket error */
    IDEM_ERR_PARSE = -14,       /* malformed input */
    IDEM_ERR_INTERRUPTED = -15, /* stopped by a signal before completion */
    IDEM_ERR_PG_ROLLBACK = -16, /* COMMIT answered ROLLBACK: an earlier statement had failed */
    IDEM_ERR_UNENCODABLE = -17, /* a message cannot be encoded for AMQP (nothing was sent) */
} idem_status;

#define IDEM_STATUS_MIN IDEM_ERR_UNENCODABLE

typedef struct idem_error {
    int code;         /* an idem_status, 0 while unset */
    char sqlstate[6]; /* PostgreSQL SQLSTATE when the error came from a statement, else "" */
    char text[512];   /* one line, passwords masked */
} idem_error_t;

/* Static text for a status code; never NULL ("unknown status" for codes out of range). */
const char *idem_strerror(int status);

/* Sets err (if non-NULL and not yet set) and returns code, for `return idem_error_set(...)`. */
int idem_error_set(idem_error_t *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Clears err (no-op on NULL). */
void idem_error_clear(idem_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
