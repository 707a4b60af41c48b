/* test_consumer_window.c - the consumer's pure decisions (src/consumer/consumer_window.c): which
 * deliveries may be tried now without a subscription's later event overtaking an earlier one, and
 * how what is done gets acked (one multiple-ack only where nothing older is unfinished). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "consumer_int.h"

#define SUB_A "aaaaaaaa-0000-4000-8000-000000000001"
#define SUB_B "bbbbbbbb-0000-4000-8000-000000000002"
#define NOW 1000000

static delivery_t D[64];
static delivery_t *W[64];

/* A window of n deliveries, tags 1..n, all READY, subscriptions from subs (NULL = none). */
static size_t window(size_t n, const char *const *subs)
{
    memset(D, 0, sizeof D);
    for (size_t i = 0; i < n; i++) {
        D[i].tag = i + 1;
        D[i].state = D_READY;
        snprintf(D[i].ev.subscription_id, sizeof D[i].ev.subscription_id, "%s",
                 subs && subs[i] ? subs[i] : "");
        W[i] = &D[i];
    }
    return n;
}

/* The tags picked, as a string "1,2,3". */
static const char *picked(size_t n, size_t max)
{
    static char out[256];
    delivery_t *p[64];
    size_t k = idemp_window_pick(W, n, NOW, p, max);
    size_t o = 0;
    out[0] = '\0';
    for (size_t i = 0; i < k; i++)
        o += (size_t)snprintf(out + o, sizeof out - o, "%s%llu", i ? "," : "",
                              (unsigned long long)p[i]->tag);
    return out;
}

static void test_all_ready_in_tag_order(void **state)
{
    (void)state;
    const char *subs[] = {SUB_A, SUB_B, SUB_A, NULL};
    size_t n = window(4, subs);
    assert_string_equal(picked(n, 10), "1,2,3,4");
    assert_string_equal(picked(n, 2), "1,2");
}

static void test_retry_holds_its_subscription(void **state)
{
    (void)state;
    const char *subs[] = {SUB_A, SUB_B, SUB_A, SUB_B, NULL};
    size_t n = window(5, subs);
    D[0].state = D_WAIT; /* A's first event waits for a retry */
    D[0].due_ms = NOW + 500;
    /* A's later event stays behind; B and the delivery without a subscription go */
    assert_string_equal(picked(n, 10), "2,4,5");
    /* once due, A's events go again, in order */
    D[0].due_ms = NOW;
    assert_string_equal(picked(n, 10), "1,2,3,4,5");
}

static void test_dead_letter_holds_nothing(void **state)
{
    (void)state;
    const char *subs[] = {SUB_A, SUB_A};
    size_t n = window(2, subs);
    D[0].state = D_DEAD;
    assert_string_equal(picked(n, 10), "2");
    D[0].state = D_DONE;
    assert_string_equal(picked(n, 10), "2");
}

static void test_full_batch_holds_the_rest_of_a_subscription(void **state)
{
    (void)state;
    /* batch of 2: A1, B1 picked; A2 must not jump ahead in a later pick while A1... it is not
     * picked now because the batch is full, and C (no subscription) neither */
    const char *subs[] = {SUB_A, SUB_B, SUB_A, SUB_B};
    size_t n = window(4, subs);
    assert_string_equal(picked(n, 2), "1,2");
    /* A1 not due: A2 stays, B goes */
    D[0].state = D_WAIT;
    D[0].due_ms = NOW + 1;
    assert_string_equal(picked(n, 1), "2");
}

static void test_next_due(void **state)
{
    (void)state;
    size_t n = window(3, NULL);
    assert_true(idemp_window_next_due(W, n) == INT64_MAX);
    D[1].state = D_WAIT;
    D[1].due_ms = NOW + 300;
    D[2].state = D_WAIT;
    D[2].due_ms = NOW + 200;
    assert_int_equal(idemp_window_next_due(W, n), NOW + 200);
}

static void test_ack_plan(void **state)
{
    (void)state;
    size_t single[64], ns;
    uint64_t multi;
    size_t n = window(6, NULL);
    /* all done: one multiple-ack up to the last */
    for (size_t i = 0; i < n; i++)
        D[i].state = D_DONE;
    ns = idemp_window_ack_plan(W, n, &multi, single);
    assert_int_equal(multi, 6);
    assert_int_equal(ns, 0);
    /* 3 waits: 1,2 together; 4 and 6 one by one; 3 and 5 stay unacked */
    D[2].state = D_WAIT;
    D[4].state = D_DEAD;
    ns = idemp_window_ack_plan(W, n, &multi, single);
    assert_int_equal(multi, 2);
    assert_int_equal(ns, 2);
    assert_int_equal(D[single[0]].tag, 4);
    assert_int_equal(D[single[1]].tag, 6);
    /* the oldest unfinished: no multiple-ack at all */
    D[0].state = D_READY;
    ns = idemp_window_ack_plan(W, n, &multi, single);
    assert_int_equal(multi, 0);
    assert_int_equal(ns, 3); /* 2, 4, 6 */
}

static void test_key_includes_the_queue(void **state)
{
    (void)state;
    const char *subs[] = {SUB_A, SUB_A, NULL};
    window(3, subs);
    D[1].qidx = 1;
    assert_true(idemp_window_key(&D[0]) != idemp_window_key(&D[1]));
    D[1].qidx = 0;
    assert_true(idemp_window_key(&D[0]) == idemp_window_key(&D[1]));
    assert_true(idemp_window_key(&D[0]) != 0);
    assert_true(idemp_window_key(&D[2]) == 0);
}

/* A batch whose COMMIT is on its way: its deliveries are not picked again, hold their
 * subscriptions' later deliveries (the next batch, on another connection, never shares a
 * subscription with it), and are not acked. */
static void test_committing_holds_its_subscription(void **state)
{
    (void)state;
    const char *subs[] = {SUB_A, SUB_B, SUB_A, SUB_B, NULL};
    size_t n = window(5, subs);
    D[0].state = D_COMMITTING; /* tag 1, SUB_A */
    assert_string_equal(picked(n, 10), "2,4,5");
    D[0].state = D_DONE;
    assert_string_equal(picked(n, 10), "2,3,4,5");
    D[0].state = D_COMMITTING;
    D[1].state = D_DONE;
    uint64_t multi = 0;
    size_t single[8];
    assert_int_equal(idemp_window_ack_plan(W, n, &multi, single), 1);
    assert_int_equal(multi, 0);
    assert_int_equal(single[0], 1); /* tag 2 alone: tag 1 still committing */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_ready_in_tag_order),
        cmocka_unit_test(test_retry_holds_its_subscription),
        cmocka_unit_test(test_dead_letter_holds_nothing),
        cmocka_unit_test(test_full_batch_holds_the_rest_of_a_subscription),
        cmocka_unit_test(test_next_due),
        cmocka_unit_test(test_ack_plan),
        cmocka_unit_test(test_key_includes_the_queue),
        cmocka_unit_test(test_committing_holds_its_subscription),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
