/* rmq_describe.c - a delivered message as JSON for an operator to read (`idem dlq show`, the
 * console): every property, every header of any AMQP kind, and the body. The bytes come from
 * whoever published the message, so nothing is trusted: text that is not UTF-8 (or holds a NUL)
 * is shown escaped, \xNN for each such byte and \\ for a backslash, and says so. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "rmq_int.h"

#define DEPTH_MAX 16 /* nested tables and arrays shown this deep */

/* A JSON string of len bytes at p; *escaped (may be NULL) tells whether it had to be escaped. */
static json_t *bytes_json(const void *p, size_t len, bool *escaped)
{
    if (escaped != NULL)
        *escaped = false;
    if (len == 0)
        return json_string("");
    if (memchr(p, '\0', len) == NULL) {
        json_t *v = json_stringn(p, len);
        if (v != NULL)
            return v;
    }
    if (escaped != NULL)
        *escaped = true;
    if (len > (SIZE_MAX - 1) / 4)
        return NULL;
    char *out = malloc(len * 4 + 1), *o = out;
    if (out == NULL)
        return NULL;
    const unsigned char *s = p;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '\\') {
            *o++ = '\\';
            *o++ = '\\';
        } else if (s[i] >= 0x20 && s[i] < 0x7f) {
            *o++ = (char)s[i];
        } else if (s[i] == '\n' || s[i] == '\t') {
            *o++ = (char)s[i];
        } else {
            o += sprintf(o, "\\x%02x", s[i]);
        }
    }
    json_t *v = json_stringn(out, (size_t)(o - out));
    free(out);
    return v;
}

static json_t *value_json(const amqp_field_value_t *v, int depth);

static json_t *table_json(const amqp_table_t *t, int depth)
{
    json_t *o = json_object();
    for (int i = 0; o != NULL && i < t->num_entries; i++) {
        const amqp_table_entry_t *e = &t->entries[i];
        json_t *k = bytes_json(e->key.bytes, e->key.len, NULL);
        const char *key = json_string_value(k);
        if (key != NULL)
            json_object_set_new(o, key, value_json(&e->value, depth + 1));
        json_decref(k);
    }
    return o;
}

static json_t *value_json(const amqp_field_value_t *v, int depth)
{
    if (depth > DEPTH_MAX)
        return json_string("(nested too deep)");
    switch (v->kind) {
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES:
        return bytes_json(v->value.bytes.bytes, v->value.bytes.len, NULL);
    case AMQP_FIELD_KIND_BOOLEAN:
        return json_boolean(v->value.boolean);
    case AMQP_FIELD_KIND_I8:
        return json_integer(v->value.i8);
    case AMQP_FIELD_KIND_U8:
        return json_integer(v->value.u8);
    case AMQP_FIELD_KIND_I16:
        return json_integer(v->value.i16);
    case AMQP_FIELD_KIND_U16:
        return json_integer(v->value.u16);
    case AMQP_FIELD_KIND_I32:
        return json_integer(v->value.i32);
    case AMQP_FIELD_KIND_U32:
        return json_integer(v->value.u32);
    case AMQP_FIELD_KIND_I64:
        return json_integer(v->value.i64);
    case AMQP_FIELD_KIND_U64:
    case AMQP_FIELD_KIND_TIMESTAMP:
        return v->value.u64 <= (uint64_t)INT64_MAX ? json_integer((json_int_t)v->value.u64)
                                                   : json_real((double)v->value.u64);
    case AMQP_FIELD_KIND_F32:
        return json_real(v->value.f32);
    case AMQP_FIELD_KIND_F64:
        return json_real(v->value.f64);
    case AMQP_FIELD_KIND_DECIMAL: {
        char s[48];
        snprintf(s, sizeof s, "%ue-%u", v->value.decimal.value, v->value.decimal.decimals);
        return json_string(s);
    }
    case AMQP_FIELD_KIND_TABLE:
        return table_json(&v->value.table, depth);
    case AMQP_FIELD_KIND_ARRAY: {
        json_t *a = json_array();
        for (int i = 0; a != NULL && i < v->value.array.num_entries; i++)
            json_array_append_new(a, value_json(&v->value.array.entries[i], depth + 1));
        return a;
    }
    default:
        return json_null();
    }
}

static void set_bytes(json_t *o, const char *name, bool present, amqp_bytes_t b)
{
    if (present)
        json_object_set_new(o, name, bytes_json(b.bytes, b.len, NULL));
}

json_t *idemp_msg_describe(const idemp_msg_t *m)
{
    const amqp_basic_properties_t *p = &m->props;
    json_t *props = json_object(), *o = json_object();
    if (props == NULL || o == NULL) {
        json_decref(props);
        json_decref(o);
        return NULL;
    }
#define PROP(flag, name) set_bytes(props, #name, (p->_flags & (flag)) != 0, p->name)
    PROP(AMQP_BASIC_CONTENT_TYPE_FLAG, content_type);
    PROP(AMQP_BASIC_CONTENT_ENCODING_FLAG, content_encoding);
    PROP(AMQP_BASIC_CORRELATION_ID_FLAG, correlation_id);
    PROP(AMQP_BASIC_REPLY_TO_FLAG, reply_to);
    PROP(AMQP_BASIC_EXPIRATION_FLAG, expiration);
    PROP(AMQP_BASIC_MESSAGE_ID_FLAG, message_id);
    PROP(AMQP_BASIC_TYPE_FLAG, type);
    PROP(AMQP_BASIC_USER_ID_FLAG, user_id);
    PROP(AMQP_BASIC_APP_ID_FLAG, app_id);
#undef PROP
    if (p->_flags & AMQP_BASIC_DELIVERY_MODE_FLAG)
        json_object_set_new(props, "delivery_mode", json_integer(p->delivery_mode));
    if (p->_flags & AMQP_BASIC_PRIORITY_FLAG)
        json_object_set_new(props, "priority", json_integer(p->priority));
    if (p->_flags & AMQP_BASIC_TIMESTAMP_FLAG)
        json_object_set_new(props, "timestamp", json_integer((json_int_t)p->timestamp));
    json_object_set_new(o, "properties", props);
    json_object_set_new(o, "headers",
                        (p->_flags & AMQP_BASIC_HEADERS_FLAG) ? table_json(&p->headers, 0)
                                                              : json_object());
    json_object_set_new(o, "routing_key",
                        bytes_json(m->routing_key.bytes, m->routing_key.len, NULL));
    json_object_set_new(o, "body_bytes", json_integer((json_int_t)m->body_size));
    bool escaped = false;
    if (m->oversized)
        json_object_set_new(o, "body", json_null());
    else
        json_object_set_new(o, "body", bytes_json(m->body.bytes, m->body.len, &escaped));
    json_object_set_new(o, "body_escaped", json_boolean(escaped));
    return o;
}
