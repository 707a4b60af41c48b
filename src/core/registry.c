/* registry.c - event type -> handler; a handful of types, so a sorted array. */
#include <stdlib.h>
#include <string.h>

#include <idem/error.h>

#include "registry.h"

struct idemp_registry {
    idemp_handler_entry_t *entries;
    size_t n, cap;
};

idemp_registry_t *idemp_registry_new(void)
{
    return calloc(1, sizeof(idemp_registry_t));
}

void idemp_registry_free(idemp_registry_t *r)
{
    if (r == NULL)
        return;
    for (size_t i = 0; i < r->n; i++)
        free(r->entries[i].event_type);
    free(r->entries);
    free(r);
}

static size_t lower_bound(const idemp_registry_t *r, const char *type)
{
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (strcmp(r->entries[mid].event_type, type) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int idemp_registry_add(idemp_registry_t *r, const char *event_type, idem_handler_fn fn,
                       void *userdata)
{
    if (r == NULL || event_type == NULL || *event_type == '\0' || fn == NULL)
        return IDEM_ERR_INVALID;
    size_t i = lower_bound(r, event_type);
    if (i < r->n && strcmp(r->entries[i].event_type, event_type) == 0) {
        r->entries[i].fn = fn;
        r->entries[i].userdata = userdata;
        return IDEM_OK;
    }
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 8;
        idemp_handler_entry_t *e = realloc(r->entries, cap * sizeof *e);
        if (e == NULL)
            return IDEM_ERR_NOMEM;
        r->entries = e;
        r->cap = cap;
    }
    char *copy = strdup(event_type);
    if (copy == NULL)
        return IDEM_ERR_NOMEM;
    memmove(&r->entries[i + 1], &r->entries[i], (r->n - i) * sizeof r->entries[0]);
    r->entries[i] = (idemp_handler_entry_t){copy, fn, userdata};
    r->n++;
    return IDEM_OK;
}

const idemp_handler_entry_t *idemp_registry_find(const idemp_registry_t *r, const char *type)
{
    if (r == NULL || type == NULL)
        return NULL;
    size_t i = lower_bound(r, type);
    return (i < r->n && strcmp(r->entries[i].event_type, type) == 0) ? &r->entries[i] : NULL;
}

size_t idemp_registry_count(const idemp_registry_t *r)
{
    return r ? r->n : 0;
}

const char *idemp_registry_type(const idemp_registry_t *r, size_t i)
{
    return (r != NULL && i < r->n) ? r->entries[i].event_type : NULL;
}
