#!/usr/bin/python3
"""Writes the small seed corpora of the libFuzzer targets to tests/fuzz/corpus/TARGET/ (seed-*
files; regress-* files are inputs of past crashes and are left alone). Run from anywhere with
Debian's interpreter (pika encodes the AMQP properties): /usr/bin/python3 tests/fuzz/make_seeds.py
"""

import json
import os
import struct
import uuid

import pika
from pika import spec

HERE = os.path.dirname(os.path.abspath(__file__))
U = "6f1c2a9e-3b7d-4c1e-9a2f-0d5e8b7c6a41"
SUB = "0a0b0c0d-1111-2222-3333-444455556666"
GOOD = json.dumps({"invoice_id": str(uuid.UUID(int=7)), "subscription_id": SUB,
                   "amount_cents": 1250, "currency": "USD"}).encode()
NOW_MS = 1790000000000


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def fld(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<H", len(b)) + b


def envelope(name, message_id=None, hdr_event_id=None, bad_kind=False, type=None,
             hdr_event_type=None, routing_key=b"", hdr_sub=None, seq=None, timestamp=None,
             body=GOOD, oversized_shift=None, limits=0x40):
    flags = 0
    flags |= 0x01 if message_id is not None else 0
    flags |= 0x02 if hdr_event_id is not None else 0
    flags |= 0x04 if bad_kind else 0
    flags |= 0x08 if type is not None else 0
    flags |= 0x10 if hdr_event_type is not None else 0
    flags |= 0x20 if hdr_sub is not None else 0
    flags |= 0x40 if seq is not None else 0
    flags |= 0x80 if timestamp is not None else 0
    if oversized_shift is not None:
        limits |= 0x80 | oversized_shift
    data = bytes([flags, limits]) + struct.pack("<QQq", timestamp or 0, NOW_MS, seq or 0)
    for v in (message_id, hdr_event_id, type, hdr_event_type, routing_key, hdr_sub):
        data += fld(v or b"")
    write("fuzz_envelope", name, data + body)


def seeds_envelope():
    pf = "payment.failed"
    envelope("good", message_id=U, type=pf, routing_key=pf, hdr_sub=SUB, seq=7,
             timestamp=NOW_MS // 1000)
    envelope("header_id", hdr_event_id="{" + U.upper() + "}", hdr_event_type=pf)
    envelope("no_hyphens", message_id=U.replace("-", ""), routing_key=pf)
    envelope("bad_kind", hdr_event_id="", bad_kind=True, type=pf)
    envelope("missing_id", type=pf)
    envelope("sqlish_id", message_id="'; DROP TABLE consumed_events; --", type=pf)
    envelope("long_type", message_id=U, type="t" * 300)
    envelope("malformed", message_id=U, type=pf, body=b'{"a":')
    envelope("array", message_id=U, type=pf, body=b"[1,2,3]")
    envelope("oversized", message_id=U, type=pf, body=b"x" * 64, oversized_shift=16)
    envelope("dupkeys", message_id=U, type=pf, body=b'{"a":1,"a":2}')
    envelope("ts_ms", message_id=U, type=pf, timestamp=NOW_MS)
    envelope("ts_max", message_id=U, type=pf, timestamp=2**64 - 1)
    envelope("nul_type", message_id=U, type=b"payment.failed\x00x")
    envelope("utf8_bad", message_id=U, type=pf, body=b'{"a":"\xff\xfe"}')


def seeds_payload():
    w = lambda name, body: write("fuzz_billing_payload", name, bytes([120]) + body)
    w("good", GOOD)
    w("braces", json.dumps({"invoice_id": "{" + U.upper() + "}", "subscription_id": SUB,
                            "amount_cents": 0, "currency": "EUR", "extra": [1, {"x": None}]}).encode())
    w("neg", GOOD.replace(b"1250", b"-1"))
    w("big", GOOD.replace(b"1250", b"92233720368547758070"))
    w("real", GOOD.replace(b"1250", b"12.5e3"))
    w("cur", GOOD.replace(b"USD", b"usd"))
    w("cur_nul", GOOD.replace(b"USD", b"US\\u0000"))
    w("nested", b"[" * 50 + b"]" * 50)
    w("string", b'"just a string"')
    w("unicode", json.dumps({"currency": "\u00c9UR", "k": "\ud83d\ude00"}).encode())


def seeds_url():
    w = lambda name, mode, text: write("fuzz_amqp_url_mask", name, bytes([mode, 200]) + text.encode())
    w("plain", 1, "amqp://guest:guest@127.0.0.1:5672/%2f")
    w("tls", 1, "amqps://u:p%40ss@[::1]:5671/vh?cacertfile=/x.pem&verify=verify_none&heartbeat=5")
    w("at_in_pw", 1, "amqp://user:pa@ss@host/")
    w("noscheme", 0, "user:secret@host:1")
    w("list", 1, "amqp://a:secret1@h1,amqp://b:secret2@h2/v")
    w("conninfo", 3, "host=db port=5432 password='se cr\\'et' sslmode=verify-full user=x")
    w("pguri", 3, "postgresql://app:hunter22@db:5432/billing?sslmode=require")
    w("query_pw", 3, "postgresql://db/x?password=hunter22&sslmode=require")
    w("newline", 1, "error at amqp://u:line\nbreak@h\tand more\n")
    # mode bit 2: an unencoded password (length byte, password, rest), scheme by bits 3-4
    for name, bits, pw, rest in (("unencoded_scheme", 0, "alpha1://bravo2", "127.0.0.1:5672"),
                                 ("unencoded_tls", 1, "alpha1@bravo2://charlie3", "h:5671/v"),
                                 ("unencoded_list", 2, "alpha1://bravo2,charlie3", "h2"),
                                 ("unencoded_quotes", 0, "alpha1'bravo2\" ://charlie3", "h/v"),
                                 ("unencoded_pg", 3, "alpha1@bravo2://charlie3", "db:5432/x"),
                                 ("unencoded_pg_query", 3, "alpha1?x=bravo2", "db/x?sslmode=a")):
        write("fuzz_amqp_url_mask", name,
              bytes([4 | bits << 3, 200, len(pw)]) + pw.encode() + rest.encode())


def seeds_digest():
    w = lambda name, t, sub, body, k=0: write("fuzz_digest", name,
                                             fld(t) + fld(sub) + fld(body) + bytes([k]))
    w("good", "invoice.paid", SUB, GOOD, 3)
    w("boundary", "ab", "c", "{}", 1)  # ("ab", "c") against ("a", "bc")
    w("empty", "", "", "{}", 0)
    w("nested", "t", SUB, json.dumps({"b": [1, {"z": 1, "a": "\u00e9"}], "a": 2.5e-7}), 9)
    w("big", "payment.failed", SUB, json.dumps({"k%d" % i: "v" * 40 for i in range(120)}), 5)
    w("escapes", "x", "", json.dumps({"s": "a/b\"c\\d\n\u2028"}), 2)


def props(**kw):
    p = spec.BasicProperties(**kw)
    return b"".join(p.encode())


def seeds_props():
    def w(name, rk, p, body=GOOD, flags=0):
        rk = rk.encode()
        data = bytes([flags, len(rk)]) + rk + struct.pack("<H", len(p)) + p + body
        write("fuzz_props_envelope", name, data)
    pf = "payment.failed"
    w("relay", pf, props(message_id=U, type=pf, content_type="application/json", delivery_mode=2,
                         timestamp=NOW_MS // 1000,
                         headers={"event_id": U, "subscription_id": SUB, "event_type": pf,
                                  "x-idem-seq": 2**40, "traceparent": "00-abc-def-01"}))
    w("header_only", pf, props(headers={"event_id": U.upper(), "event_type": pf}))
    w("bad_kinds", pf, props(headers={"event_id": 5, "event_type": ["a"], "subscription_id": {"x": 1},
                                      "x-idem-seq": "7"}))
    w("expiration_user", pf, props(message_id=U, expiration="60000", user_id="other",
                                   headers={"x-idem-original-user-id": "spoof", "x-idem-error": "old"}))
    w("nested", "", props(message_id=U, headers={"a": {"b": {"c": [1, 2, {"d": True}]}}}))
    w("oversized", pf, props(message_id=U, type=pf), body=b"x" * 100, flags=1)
    w("many", pf, props(message_id=U, headers={f"h{i}": "v" * 50 for i in range(40)}))
    # for a broker that negotiated frame_max 4096 (flags bit 2): the copy must drop headers
    w("small_frame", pf, props(message_id=U, type=pf, expiration="1000", user_id="guest",
                               headers={f"h{i:02d}": "v" * 100 for i in range(36)}),
      body=b"{", flags=4)
    w("nonutf8_key", pf, props(message_id=U, type=pf, headers={"ok": "v"}))


def regressions():
    """The inputs of crashes found (regress-*): they fail the targets until fixed."""
    # a header name that is not UTF-8 (pika will not write one): patched into a seed
    src = os.path.join(HERE, "corpus", "fuzz_props_envelope", "seed-nonutf8_key")
    data = open(src, "rb").read()
    os.unlink(src)
    with open(os.path.join(HERE, "corpus", "fuzz_props_envelope",
                           "regress-headers_json_nonutf8_key"), "wb") as f:
        f.write(data.replace(b"\x02ok", b"\x02\xffk", 1))
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask", "regress-sslpassword"), "wb") as f:
        f.write(bytes([3, 200]) + b"postgresql://db/x?password=hunter22&sslpassword=hunter33")
    # a password with a blank, which the URL parser accepts as it is
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask", "regress-blank_in_password"),
              "wb") as f:
        f.write(bytes([1, 200]) + b"amqp://user:pass word@host/")
    # the same in a PostgreSQL URI, whose password libpq reads with its blanks
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask", "regress-blank_in_pg_uri_password"),
              "wb") as f:
        f.write(bytes([3, 200]) + b"postgresql://u:top secret@h/db")
    # libpq skips any blank around a keyword's '=', the mask only ' '
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask",
                           "regress-newline_after_password_equals"), "wb") as f:
        f.write(bytes([3, 200]) + b"host=db password=\n hunter22 user=x")
    # '&' ends the mask's value (right in a URI query only); libpq's backslash escapes
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask", "regress-ampersand_in_password"),
              "wb") as f:
        f.write(bytes([3, 200]) + b"host=db password=abc&hunter22 user=x")
    # a URI query value is raw for libpq: a leading quote is no quoting
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask",
                           "regress-quote_in_uri_query_password"), "wb") as f:
        f.write(bytes([3, 200]) + b"postgresql://db/x?password='a'hunter22")
    # an '@' in a URI's query password, after a userinfo with a password
    with open(os.path.join(HERE, "corpus", "fuzz_amqp_url_mask",
                           "regress-at_in_uri_query_password"), "wb") as f:
        f.write(bytes([3, 200]) + b"postgresql://u:pw@h?password=abc@hunter22")
    # an empty header name: amqp_table_clone refuses it
    p = props(message_id=U, type="payment.failed", headers={"": "x"})
    with open(os.path.join(HERE, "corpus", "fuzz_props_envelope", "regress-empty_header_name"),
              "wb") as f:
        f.write(bytes([0, 0]) + struct.pack("<H", len(p)) + p + GOOD)
    # a header value with a NUL byte: rendered as \u0000, which jsonb refuses
    p = props(message_id=U, type="payment.failed", headers={"trace": "a\x00b"})
    with open(os.path.join(HERE, "corpus", "fuzz_props_envelope", "regress-headers_json_nul_value"),
              "wb") as f:
        f.write(bytes([0, 0]) + struct.pack("<H", len(p)) + p + GOOD)


if __name__ == "__main__":
    seeds_envelope()
    seeds_payload()
    seeds_url()
    seeds_digest()
    seeds_props()
    regressions()
