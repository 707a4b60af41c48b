/* test_log.c - log lines cannot be forged (src/util/log.c): in text, control characters, quotes and
 * bytes that are not UTF-8 are escaped and a line stays one line; in JSON every line is valid
 * JSON that keeps msg. 1,000 random byte strings go through both formats as event types, ids and
 * messages. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include <idem/log.h>

#include "mask.h"

static void test_escape(void **state)
{
    (void)state;
    char out[256];
    idemp_log_escape("a\x01"
                     "b\x1b[31mc\x7f",
                     out, sizeof out, true);
    assert_string_equal(out, "a\\x01b\\x1B[31mc\\x7F");
    idemp_log_escape("say \"hi\" \\ there", out, sizeof out, true);
    assert_string_equal(out, "say \\\"hi\\\" \\\\ there");
    idemp_log_escape("say \"hi\"", out, sizeof out, false); /* JSON escapes its own quotes */
    assert_string_equal(out, "say \"hi\"");
    idemp_log_escape("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x92\xb8", out, sizeof out, true);
    assert_string_equal(out, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x92\xb8"); /* valid UTF-8 kept */
    idemp_log_escape("bad \xc3 \xff \xed\xa0\x80 \xc0\xaf", out, sizeof out, false);
    assert_string_equal(out, "bad \\xC3 \\xFF \\xED\\xA0\\x80 \\xC0\\xAF");
    /* truncation never splits an escape or a character */
    idemp_log_escape("\x01\x01\x01", out, 7, true);
    assert_string_equal(out, "\\x01");
}

static char *random_bytes(unsigned *seed, size_t *len)
{
    size_t n = 1 + (size_t)(rand_r(seed) % 200);
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        int b = rand_r(seed) % 256;
        s[i] = (char)(b == 0 ? 1 : b); /* C strings: no NUL inside */
    }
    s[n] = '\0';
    *len = n;
    return s;
}

/* Logs 1,000 random strings in format f to a file; returns the file's text. */
static char *log_random(idem_log_format f, unsigned seed)
{
    char path[] = "/tmp/idem-test-log-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    idem_log_set_format(f);
    idem_log_set_level(IDEM_LOG_DEBUG);
    for (int i = 0; i < 1000; i++) {
        size_t l1, l2, l3;
        char *type = random_bytes(&seed, &l1), *id = random_bytes(&seed, &l2);
        char *m = random_bytes(&seed, &l3);
        const char *kv[] = {"event_type", type, "event_id", id, NULL};
        idem_log(IDEM_LOG_WARN, "consumer", kv, "dead-lettered: %s", m);
        free(type);
        free(id);
        free(m);
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    FILE *in = fdopen(fd, "r");
    fseek(in, 0, SEEK_END);
    long sz = ftell(in);
    fseek(in, 0, SEEK_SET);
    char *text = malloc((size_t)sz + 1);
    size_t got = fread(text, 1, (size_t)sz, in);
    text[got] = '\0';
    fclose(in);
    unlink(path);
    return text;
}

static void test_json_lines_always_valid(void **state)
{
    (void)state;
    char *text = log_random(IDEM_LOG_JSON, 7);
    int lines = 0;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n"), lines++) {
        json_error_t e;
        json_t *o = json_loads(line, 0, &e);
        if (o == NULL)
            fail_msg("line %d is not JSON (%s): %.200s", lines, e.text, line);
        assert_non_null(json_string_value(json_object_get(o, "msg")));
        assert_non_null(json_string_value(json_object_get(o, "event_type")));
        assert_non_null(json_string_value(json_object_get(o, "event_id")));
        json_decref(o);
    }
    assert_int_equal(lines, 1000);
    free(text);
}

static void test_text_lines_cannot_be_forged(void **state)
{
    (void)state;
    char *text = log_random(IDEM_LOG_TEXT, 11);
    int lines = 0;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n"), lines++) {
        for (const unsigned char *p = (const unsigned char *)line; *p; p++)
            if (*p < 0x20 || *p == 0x7f)
                fail_msg("line %d carries control byte 0x%02x", lines, *p);
        /* every field after the message is key=value or key="value" with escaped quotes */
        const char *et = strstr(line, " event_type=");
        assert_non_null(et);
    }
    assert_int_equal(lines, 1000); /* no random string made a second line */
    free(text);
    idem_log_set_format(IDEM_LOG_TEXT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_escape),
        cmocka_unit_test(test_json_lines_always_valid),
        cmocka_unit_test(test_text_lines_cannot_be_forged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
