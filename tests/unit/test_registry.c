/* test_registry.c - the event type -> handler map (src/core/registry.c): add, find, replace, count,
 * sorted order, invalid arguments. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <idem/error.h>

#include "registry.h"

static idem_outcome h1(idem_event_t *ev, void *ud)
{
    (void)ev;
    (void)ud;
    return IDEM_DONE;
}

static idem_outcome h2(idem_event_t *ev, void *ud)
{
    (void)ev;
    (void)ud;
    return IDEM_RETRY;
}

static idem_outcome h3(idem_event_t *ev, void *ud)
{
    (void)ev;
    (void)ud;
    return IDEM_REJECT;
}

static int setup(void **state)
{
    idemp_registry_t *r = idemp_registry_new();
    if (r == NULL)
        return -1;
    *state = r;
    return 0;
}

static int teardown(void **state)
{
    idemp_registry_free(*state);
    return 0;
}

static void test_empty(void **state)
{
    idemp_registry_t *r = *state;
    assert_int_equal(idemp_registry_count(r), 0);
    assert_null(idemp_registry_find(r, "invoice.paid"));
    assert_null(idemp_registry_find(r, ""));
    assert_null(idemp_registry_type(r, 0));
}

static void test_add_find(void **state)
{
    idemp_registry_t *r = *state;
    int ud1 = 1, ud2 = 2;
    assert_int_equal(idemp_registry_add(r, "invoice.paid", h1, &ud1), IDEM_OK);
    assert_int_equal(idemp_registry_add(r, "payment.failed", h2, &ud2), IDEM_OK);
    assert_int_equal(idemp_registry_count(r), 2);

    const idemp_handler_entry_t *e = idemp_registry_find(r, "invoice.paid");
    assert_non_null(e);
    assert_string_equal(e->event_type, "invoice.paid");
    assert_ptr_equal(e->fn, h1);
    assert_ptr_equal(e->userdata, &ud1);

    e = idemp_registry_find(r, "payment.failed");
    assert_non_null(e);
    assert_string_equal(e->event_type, "payment.failed");
    assert_ptr_equal(e->fn, h2);
    assert_ptr_equal(e->userdata, &ud2);

    /* exact match only: no prefixes, no case folding */
    assert_null(idemp_registry_find(r, "invoice"));
    assert_null(idemp_registry_find(r, "invoice.paid.x"));
    assert_null(idemp_registry_find(r, "Invoice.Paid"));
    assert_null(idemp_registry_find(r, "receipt.requested"));
    assert_null(idemp_registry_find(r, ""));
    assert_null(idemp_registry_find(r, NULL));
}

static void test_copies_type(void **state)
{
    idemp_registry_t *r = *state;
    char type[32];
    strcpy(type, "invoice.paid");
    assert_int_equal(idemp_registry_add(r, type, h1, NULL), IDEM_OK);
    strcpy(type, "overwritten!");
    const idemp_handler_entry_t *e = idemp_registry_find(r, "invoice.paid");
    assert_non_null(e);
    assert_string_equal(e->event_type, "invoice.paid");
    assert_ptr_not_equal(e->event_type, type);
    assert_null(idemp_registry_find(r, "overwritten!"));
}

static void test_replace(void **state)
{
    idemp_registry_t *r = *state;
    int ud1 = 1, ud2 = 2;
    assert_int_equal(idemp_registry_add(r, "a.x", h3, NULL), IDEM_OK);
    assert_int_equal(idemp_registry_add(r, "invoice.paid", h1, &ud1), IDEM_OK);
    assert_int_equal(idemp_registry_add(r, "z.x", h3, NULL), IDEM_OK);
    assert_int_equal(idemp_registry_add(r, "invoice.paid", h2, &ud2), IDEM_OK);
    assert_int_equal(idemp_registry_count(r), 3);
    const idemp_handler_entry_t *e = idemp_registry_find(r, "invoice.paid");
    assert_non_null(e);
    assert_ptr_equal(e->fn, h2);
    assert_ptr_equal(e->userdata, &ud2);
    /* replacing with NULL userdata clears it */
    assert_int_equal(idemp_registry_add(r, "invoice.paid", h1, NULL), IDEM_OK);
    e = idemp_registry_find(r, "invoice.paid");
    assert_ptr_equal(e->fn, h1);
    assert_null(e->userdata);
    assert_int_equal(idemp_registry_count(r), 3);
    /* the neighbours are untouched */
    assert_ptr_equal(idemp_registry_find(r, "a.x")->fn, h3);
    assert_ptr_equal(idemp_registry_find(r, "z.x")->fn, h3);
}

static void test_order(void **state)
{
    idemp_registry_t *r = *state;
    const char *in[] = {"receipt.requested",
                        "payment.failed",
                        "invoice.paid",
                        "a",
                        "zz",
                        "invoice.paid.v2",
                        "Invoice",
                        "m"};
    const char *sorted[] = {"Invoice",           "a", "invoice.paid",
                            "invoice.paid.v2",   "m", "payment.failed",
                            "receipt.requested", "zz"};
    size_t n = sizeof in / sizeof in[0];
    for (size_t i = 0; i < n; i++)
        assert_int_equal(idemp_registry_add(r, in[i], h1, (void *)in[i]), IDEM_OK);
    assert_int_equal(idemp_registry_count(r), n);
    for (size_t i = 0; i < n; i++) {
        assert_non_null(idemp_registry_type(r, i));
        assert_string_equal(idemp_registry_type(r, i), sorted[i]);
        /* each entry still carries its own userdata after the inserts moved it */
        const idemp_handler_entry_t *e = idemp_registry_find(r, sorted[i]);
        assert_non_null(e);
        assert_string_equal((const char *)e->userdata, sorted[i]);
    }
    assert_null(idemp_registry_type(r, n));
    assert_null(idemp_registry_type(r, (size_t)-1));
}

static void test_grows(void **state)
{
    idemp_registry_t *r = *state;
    char type[32];
    /* past the initial capacity, in descending order so every insert shifts the array */
    for (int i = 99; i >= 0; i--) {
        snprintf(type, sizeof type, "type.%03d", i);
        assert_int_equal(idemp_registry_add(r, type, i % 2 ? h1 : h2, NULL), IDEM_OK);
    }
    assert_int_equal(idemp_registry_count(r), 100);
    for (int i = 0; i < 100; i++) {
        snprintf(type, sizeof type, "type.%03d", i);
        assert_string_equal(idemp_registry_type(r, (size_t)i), type);
        const idemp_handler_entry_t *e = idemp_registry_find(r, type);
        assert_non_null(e);
        assert_ptr_equal(e->fn, i % 2 ? h1 : h2);
    }
    assert_null(idemp_registry_find(r, "type.100"));
}

static void test_invalid(void **state)
{
    idemp_registry_t *r = *state;
    assert_int_equal(idemp_registry_add(r, NULL, h1, NULL), IDEM_ERR_INVALID);
    assert_int_equal(idemp_registry_add(r, "", h1, NULL), IDEM_ERR_INVALID);
    assert_int_equal(idemp_registry_add(r, "invoice.paid", NULL, NULL), IDEM_ERR_INVALID);
    assert_int_equal(idemp_registry_add(NULL, "invoice.paid", h1, NULL), IDEM_ERR_INVALID);
    assert_int_equal(idemp_registry_count(r), 0);
    assert_null(idemp_registry_find(r, "invoice.paid"));

    /* a NULL fn does not erase an existing entry */
    assert_int_equal(idemp_registry_add(r, "invoice.paid", h1, NULL), IDEM_OK);
    assert_int_equal(idemp_registry_add(r, "invoice.paid", NULL, NULL), IDEM_ERR_INVALID);
    assert_ptr_equal(idemp_registry_find(r, "invoice.paid")->fn, h1);
    assert_int_equal(idemp_registry_count(r), 1);

    /* NULL registry: harmless */
    assert_int_equal(idemp_registry_count(NULL), 0);
    assert_null(idemp_registry_find(NULL, "invoice.paid"));
    assert_null(idemp_registry_type(NULL, 0));
    idemp_registry_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_empty, setup, teardown),
        cmocka_unit_test_setup_teardown(test_add_find, setup, teardown),
        cmocka_unit_test_setup_teardown(test_copies_type, setup, teardown),
        cmocka_unit_test_setup_teardown(test_replace, setup, teardown),
        cmocka_unit_test_setup_teardown(test_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_grows, setup, teardown),
        cmocka_unit_test_setup_teardown(test_invalid, setup, teardown),
    };
    return cmocka_run_group_tests_name("registry", tests, NULL, NULL);
}
