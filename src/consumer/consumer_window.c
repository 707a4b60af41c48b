/* consumer_window.c - pure decisions over the deliveries in hand: which may be tried now without
 * letting a subscription's later event overtake an earlier one, and what can be acked. */
#include <string.h>

#include "consumer_int.h"

/* Subscriptions held back by an unfinished earlier delivery, as 64-bit hashes. A collision or an
 * overflow only holds back more than needed: a delay, never a reordering. */
#define HELD_MAX 512

typedef struct held {
    uint64_t h[HELD_MAX];
    size_t n;
    bool overflow;
} held_t;

static uint64_t key_hash(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h | 1; /* never 0 */
}

static bool is_held(const held_t *hs, uint64_t h)
{
    if (hs->overflow)
        return true;
    for (size_t i = 0; i < hs->n; i++)
        if (hs->h[i] == h)
            return true;
    return false;
}

static void hold(held_t *hs, uint64_t h)
{
    if (is_held(hs, h))
        return;
    if (hs->n == HELD_MAX)
        hs->overflow = true;
    else
        hs->h[hs->n++] = h;
}

uint64_t idemp_window_key(const delivery_t *d)
{
    const char *key = d->ev.subscription_id;
    if (key[0] == '\0')
        return 0;
    uint64_t h = key_hash(key);
    h = (h ^ (uint64_t)(unsigned)d->qidx) * 1099511628211ULL; /* the queue is part of the key */
    return h | 1;
}

size_t idemp_window_pick(delivery_t *const *win, size_t n, int64_t now, delivery_t **out,
                         size_t max)
{
    held_t hs; /* keys that stay behind an unfinished earlier delivery */
    hs.n = 0;
    hs.overflow = false;
    size_t got = 0;
    for (size_t i = 0; i < n; i++) {
        delivery_t *d = win[i];
        if (d->state == D_DONE || d->state == D_DEAD)
            continue;
        uint64_t h = idemp_window_key(d);
        if (h != 0 && is_held(&hs, h))
            continue;
        bool due = d->state == D_READY || (d->state == D_WAIT && d->due_ms <= now);
        if (due && got < max) {
            out[got++] = d;
            continue;
        }
        if (h != 0)
            hold(&hs, h); /* it stays behind: so do the later ones of its key */
    }
    return got;
}

int64_t idemp_window_next_due(delivery_t *const *win, size_t n)
{
    int64_t next = INT64_MAX;
    for (size_t i = 0; i < n; i++)
        if (win[i]->state == D_WAIT && win[i]->due_ms < next)
            next = win[i]->due_ms;
    return next;
}

size_t idemp_window_ack_plan(delivery_t *const *win, size_t n, uint64_t *multi_tag, size_t *single)
{
    size_t i = 0, ns = 0;
    *multi_tag = 0;
    /* the window is in tag order: DONE deliveries before the first unfinished one go together */
    for (; i < n && win[i]->state == D_DONE; i++)
        *multi_tag = win[i]->tag;
    for (; i < n; i++)
        if (win[i]->state == D_DONE)
            single[ns++] = i;
    return ns;
}
