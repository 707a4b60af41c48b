/* idem/idem.h - the whole public API of idem. A function not declared under include/idem/ is
 * not part of the API. */
#ifndef IDEM_IDEM_H
#define IDEM_IDEM_H

#include <idem/error.h>
#include <idem/log.h>
#include <idem/duration.h>
#include <idem/handler.h>
#include <idem/consumer.h>
#include <idem/outbox.h>
#include <idem/uuid.h>
#include <idem/relay.h>
#include <idem/ops.h>
#include <idem/console.h>

#define IDEM_VERSION "0.3.0"

#endif
