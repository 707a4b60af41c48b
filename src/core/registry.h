/* registry.h - event type -> handler. */
#ifndef IDEM_REGISTRY_H
#define IDEM_REGISTRY_H

#include <stddef.h>

#include <idem/handler.h>

typedef struct idemp_handler_entry {
    char *event_type;
    idem_handler_fn fn;
    void *userdata;
} idemp_handler_entry_t;

typedef struct idemp_registry idemp_registry_t;

idemp_registry_t *idemp_registry_new(void);
void idemp_registry_free(idemp_registry_t *r);
/* Adds or replaces; 0, IDEM_ERR_INVALID (empty type, NULL fn) or IDEM_ERR_NOMEM. */
int idemp_registry_add(idemp_registry_t *r, const char *event_type, idem_handler_fn fn,
                       void *userdata);
/* Borrowed entry for type, or NULL. */
const idemp_handler_entry_t *idemp_registry_find(const idemp_registry_t *r, const char *type);
size_t idemp_registry_count(const idemp_registry_t *r);
const char *idemp_registry_type(const idemp_registry_t *r, size_t i);

#endif
