"""Hostile input, as data: every case of tests/hostile/*.json is published to a running consumer
(or, for kind "outbox", inserted into event_outbox under a running relay) and must end as its file
says, without hurting anything else.

A message case (kinds body, properties, event_id, headers, oversized) must, within 5 s:
- reach QUEUE.dlq with x-idem-error "<code>: <detail>" (expect.dead_letter: a code, or a list of
  acceptable codes) and its original body, or be applied exactly once (expect.applied: one
  ledger row for its event id, the dunning step of its subscription at 1);
- leave the consumer running, with idem_reconnects_total unchanged (the case caused no
  reconnect), and idem_consumer_dead_lettered_total{code} counting it;
- let a good event published after it be applied (other events still flow).

Beyond the corpus: what operators see of hostile copies (`idem dlq list`, JSON logs).

An outbox case is a row that cannot be published because of what it carries; all of them are
inserted among good rows, and each must park `failed` alone at max attempts while every good row
is sent (contract, "Failure policy (relay)").

Case file format (see tests/hostile/README.md): kind, about, consumer (a profile: shared,
isolated, small_stack, sql, memory_limit), repeat, message {via, properties, headers,
headers_raw, body}, expect, copy (what the dead-letter copy must show), known_defect (the
implementation is known not to meet the case yet: the test is an expected failure, strict, so
it fails as soon as the defect is fixed and the marker must go).
"""

import base64
import contextlib
import glob
import hashlib
import json
import os
import re
import struct
import sys
import time
import urllib.parse
import uuid

import pika
import pika.data
import pytest

from conftest import (EXCHANGE, Consumer, Db, admin_exec, finish_daemons, new_id, wait_until)

HOSTILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hostile")
PF = "payment.failed"
WITHIN = 5.0  # seconds a case has to reach the DLQ or be applied
MAX_BYTES = 1048576  # the consumer's --max-message-bytes (the default)


def load_cases(kinds):
    out = []
    for path in sorted(glob.glob(os.path.join(HOSTILE, "*.json"))):
        with open(path) as f:
            c = json.load(f)
        c["name"] = os.path.basename(path)[:-5]
        if c["kind"] in kinds:
            out.append(c)
    return out


MESSAGE_CASES = load_cases({"body", "properties", "event_id", "headers", "oversized"})
OUTBOX_CASES = load_cases({"outbox"})


def sanitizer_build():
    """Is build/idem (or IDEM_BIN) built with AddressSanitizer (make sanitize)?"""
    from conftest import IDEM
    try:
        with open(IDEM, "rb") as f:
            return b"__asan_init" in f.read()
    except OSError:
        return False


def params(cases):
    out = []
    for c in cases:
        known = c.get("known_defect")
        if known and c.get("known_defect_build") == "asan" and not sanitizer_build():
            known = None  # only a sanitizer build shows it
        marks = [pytest.mark.xfail(reason=known, strict=True)] if known else []
        if c.get("consumer") == "memory_limit" and sanitizer_build():
            # AddressSanitizer reserves terabytes of address space for its shadow memory
            marks.append(pytest.mark.skip(reason="an address-space limit under AddressSanitizer"))
        if c.get("slow"):
            marks.append(pytest.mark.slow)
        out.append(pytest.param(c, id=c["name"], marks=marks))
    return out


# ----------------------------------------------------------------------------- raw AMQP encoding
# pika encodes Python values; these markers let a case put exact bytes on the wire: a header
# value already encoded (kind octet + data), or a whole headers table already encoded.


class RawValue(bytes):
    pass


class RawTable(bytes):
    pass


_encode_value = pika.data.encode_value
_encode_table = pika.data.encode_table


def _encode_value_raw(pieces, value):
    if isinstance(value, RawValue):
        pieces.append(bytes(value))
        return len(value)
    return _encode_value(pieces, value)


def _encode_table_raw(pieces, table):
    if isinstance(table, RawTable):
        pieces.append(struct.pack(">I", len(table)))
        pieces.append(bytes(table))
        return 4 + len(table)
    return _encode_table(pieces, table)


pika.data.encode_value = _encode_value_raw
pika.data.encode_table = _encode_table_raw


def shortstr(b):
    assert len(b) <= 255
    return bytes([len(b)]) + b


def longstr_value(b):
    return RawValue(b"S" + struct.pack(">I", len(b)) + b)


def deep_table(depth):
    """A table value nested depth levels: {"a": {"a": ... {"a": 1}}}, encoded inside out."""
    v = b"b\x01"
    for _ in range(depth):
        v = b"F" + struct.pack(">I", 2 + len(v)) + b"\x01a" + v
    return RawValue(v)


def deep_array(depth):
    v = b"b\x01"
    for _ in range(depth):
        v = b"A" + struct.pack(">I", len(v)) + v
    return RawValue(v)


# ----------------------------------------------------------------------------- a case, made concrete


class Made:
    """One case turned into what is published: ids, properties, headers, body."""

    def __init__(self, case, index=0):
        self.case = case
        self.name = case["name"] + (f"#{index}" if index else "")
        self.event_id = new_id()
        self.sub = new_id()
        self.now = int(time.time())
        m = case.get("message", {})
        self.via = m.get("via", "queue")
        self.body = self.make_body(m.get("body"), index)
        props = {"message_id": "$ID", "type": PF, "timestamp": "$NOW",
                 "content_type": "application/json", "delivery_mode": 2}
        props.update(m.get("properties", {}))
        self.props = {k: self.value(v) for k, v in props.items() if v is not None}
        if "headers_raw" in m:
            raw = b""
            for key, v in m["headers_raw"] + [["x-case", {"S": self.name}]]:
                raw += shortstr(key.encode()) + longstr_value(self.subst(v["S"]).encode())
            self.headers = RawTable(raw)
        else:
            h = {}
            for k, v in (m.get("headers") or {}).items():
                if k == "$many":
                    h.update({f"h{i:05d}": "v" * 20 for i in range(v)})
                    continue
                h[self.key(k)] = self.header_value(v)
            h["x-case"] = self.name
            self.headers = h

    # placeholders: $ID and its forms, $SUB, $NOW
    def subst(self, s):
        eid = self.event_id
        hexid = eid.replace("-", "")
        forms = {
            "$ID_UPPER": eid.upper(), "$ID_NOHYPHEN": hexid,
            "$ID_HYPHEN4": "-".join(hexid[i:i + 4] for i in range(0, 32, 4)),
            "$ID_SHORT": hexid[:31], "$ID_DOUBLEHYPHEN": eid[:8] + "--" + eid[9:],
            "$ID": eid, "$SUB": self.sub,
        }
        for k, v in forms.items():
            s = s.replace(k, v)
        return s

    def value(self, v):
        if v == "$NOW":
            return self.now
        if isinstance(v, str):
            return self.subst(v)
        if isinstance(v, dict):
            if "now_times" in v:
                return self.now * v["now_times"]
            if "now_plus" in v:
                return self.now + v["now_plus"]
            if "$b64" in v:
                return base64.b64decode(v["$b64"])
            if v.get("$b64_id_nul"):
                return self.event_id.replace("-", "").encode() + b"\x00junk"
        return v

    @staticmethod
    def key(k):
        return base64.b64decode(k[5:]) if k.startswith("$b64:") else k

    def header_value(self, v):
        if isinstance(v, str):
            return self.subst(v)
        if isinstance(v, list):
            return [self.header_value(x) for x in v]
        if isinstance(v, dict):
            if "$bytes" in v:
                return self.subst(v["$bytes"]).encode()
            if "$S_b64" in v:
                return longstr_value(base64.b64decode(v["$S_b64"]))
            if "$raw_b64" in v:
                return RawValue(base64.b64decode(v["$raw_b64"]))
            if "$big_string" in v:
                return "h" * v["$big_string"]
            if "$deep_table" in v:
                return deep_table(v["$deep_table"])
            if "$deep_array" in v:
                return deep_array(v["$deep_array"])
            return {self.key(k): self.header_value(x) for k, x in v.items()}
        return v

    def good_fields(self):
        return {"invoice_id": str(uuid.uuid4()), "subscription_id": self.sub,
                "amount_cents": 1250, "currency": "USD"}

    def make_body(self, spec, index):
        if spec is None:
            return json.dumps(self.good_fields()).encode()
        if "text" in spec:
            return self.subst(spec["text"]).encode()
        if "base64" in spec:
            return base64.b64decode(spec["base64"]).replace(b"$SUB", self.sub.encode())
        g = spec["generate"]
        good = json.dumps(self.good_fields())[:-1]
        if g == "deep":
            return (good + ',"x":' + spec["open"] * spec["depth"] + "1"
                    + spec["close"] * spec["depth"] + "}").encode()
        if g == "deep_bare":
            return (spec["open"] * spec["depth"] + spec["close"] * spec["depth"]).encode()
        if g == "size":
            head = good + ',"pad":"'
            return (head + "x" * (spec["size"] - len(head) - 2) + '"}').encode()
        if g == "many_fields":
            return (good + "".join(f',"f{i}":{i}' for i in range(spec["count"])) + "}").encode()
        if g == "long_key":
            return (good + ',"' + "k" * spec["length"] + '":1}').encode()
        if g == "fill":
            # distinct bodies, so that each copy can be told from the others byte for byte
            seed = hashlib.sha256(f"{self.name}:{index}".encode()).digest()
            block = (seed * (1 << 15))[: 1 << 20]
            return block * (spec["size"] >> 20) + block[: spec["size"] & ((1 << 20) - 1)]
        raise ValueError(f"unknown body generator {g}")

    def publish(self, broker, queue):
        routing_key = PF if self.via == "exchange" else queue
        exchange = EXCHANGE if self.via == "exchange" else ""
        p = dict(self.props)
        broker.publish_raw(self.body, routing_key=routing_key, exchange=exchange,
                           message_id=p.pop("message_id", None), type=p.pop("type", None),
                           headers=self.headers, timestamp=p.pop("timestamp", None),
                           content_type=p.pop("content_type", None),
                           delivery_mode=p.pop("delivery_mode", None), **p)


# ----------------------------------------------------------------------------- the stage


SQL_HANDLER = """
CREATE SCHEMA hostile;
CREATE TABLE hostile.seen (event_id uuid PRIMARY KEY, headers jsonb);
CREATE FUNCTION hostile.on_event(event_id uuid, event_type text, subscription_id uuid,
                                 payload jsonb, headers jsonb) RETURNS void
LANGUAGE sql AS $$ INSERT INTO hostile.seen VALUES (event_id, headers) $$;
"""

PROFILES = {
    # name: (isolated: a consumer of its own per case, extra argv, wrapper)
    "shared": (False, [], None),
    "isolated": (True, [], None),
    "small_stack": (True, [], ["bash", "-c", 'ulimit -Ss 2048 && exec "$@"', "bash"]),
    "sql": (True, ["--handler", f"{PF}=hostile.on_event"], None),
    "memory_limit": (True, [], ["prlimit", f"--as={512 * 1024 * 1024}", "--"]),
    "json_log": (True, ["--log-format", "json"], None),
}


class Stage:
    """One database, the shared consumer (logged in as another RabbitMQ user than the
    publisher's, so that user_id cases test the copy), and consumers of their own for the
    isolated profiles; what reached the dead-letter queues, by case name."""

    def __init__(self, servers, broker, db, workdir):
        self.servers = servers
        self.broker = broker
        self.db = db
        self.workdir = workdir
        self.daemons = []
        self.queues = []
        self.letters = {}  # case name -> Delivery
        self.other_url = None
        self.shared = None
        self.db.execute(SQL_HANDLER)

    def other_user(self):
        if self.other_url is None:
            user = "it_hostile_" + uuid.uuid4().hex[:8]
            password = uuid.uuid4().hex
            try:
                self.servers.rmqctl("add_user", user, password)
                self.servers.rmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
            except (RuntimeError, AssertionError, pytest.skip.Exception):
                self.other_url = self.servers.amqp_url  # not ours: the publisher's user
                return self.other_url
            self.user = user
            u = urllib.parse.urlsplit(self.servers.amqp_url)
            self.other_url = urllib.parse.urlunsplit(
                u._replace(netloc=f"{user}:{password}@{u.hostname}:{u.port}"))
        return self.other_url

    def new_queue(self, tag):
        q = f"it.hostile.{tag}.{uuid.uuid4().hex[:8]}"
        self.queues.append(q)
        return q

    def consumer(self, profile):
        isolated, args, wrapper = PROFILES[profile]
        if not isolated and self.shared is not None:
            if not self.shared.running():
                # a case killed it: start it again for the next cases (that case has failed)
                self.shared.spawn()
                self.shared.wait_ready()
            return self.shared
        q = self.new_queue(profile)
        env = {"IDEM_AMQP_URL": self.other_user()} if not isolated else None
        c = Consumer("billing", q, self.db, self.servers, self.broker, self.workdir,
                     args=["--heartbeat", "5s", *args], env=env)
        if wrapper:
            c.argv = wrapper + c.argv
        self.daemons.append(c)
        c.start()
        if not isolated:
            self.shared = c
        return c

    def done_with(self, c):
        """An isolated consumer is stopped and its queues deleted (nothing fans out to them)."""
        if c is self.shared:
            return
        with contextlib.suppress(Exception):
            c.stop(10)
        c.kill()
        self.broker.delete_queue(c.queue)
        self.broker.delete_queue(c.queue + ".dlq")

    def collect(self, queue):
        if self.broker.queue_info(queue + ".dlq") is None:
            return
        # pika decodes a header table recursively: deeply nested ones need a higher limit
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 200000))
        try:
            got = self.broker.get_all(queue + ".dlq")
        finally:
            sys.setrecursionlimit(limit)
        for d in got:
            name = raw_header(d, "x-case")
            name = name.decode(errors="replace") if isinstance(name, bytes) else name
            if name is None:  # headers dropped from the copy: find it by its message id
                name = d.props.message_id
            self.letters[name] = d

    def close(self, request):
        finish_daemons(self.daemons, request)
        for q in self.queues:
            self.broker.delete_queue(q)
            self.broker.delete_queue(q + ".dlq")
        if getattr(self, "user", None):
            with contextlib.suppress(Exception):
                self.servers.rmqctl("delete_user", self.user)


@pytest.fixture(scope="module")
def stage(servers, broker, template_db, tmp_path_factory, request):
    name = "t_hostile_" + uuid.uuid4().hex[:12]
    admin_exec(servers, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    s = Stage(servers, broker, Db(servers.db_url(name)), str(tmp_path_factory.mktemp("hostile")))
    yield s
    s.close(request)
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def print_logs_on_failure(stage, request):
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for d in stage.daemons:
            print(f"\n----- log of {d.name} ({d.logpath}):\n{d.log()[-4000:]}")


def raw_header(d, name):
    return (d.props.headers or {}).get(name)


def error_of(d):
    """x-idem-error as text, and whether it was UTF-8 (a string header must be)."""
    v = raw_header(d, "x-idem-error")
    if isinstance(v, bytes):
        try:
            return v.decode(), True
        except UnicodeDecodeError:
            return v.decode(errors="replace"), False
    return v or "", True


def reconnects(c):
    return c.metric("idem_reconnects_total")


def applied_once(db, made, sql_profile):
    if sql_profile:
        n = db.scalar("SELECT count(*) FROM hostile.seen WHERE event_id = %s", made.event_id)
    else:
        n = db.dunning_step(made.sub)
    rows = db.scalar("SELECT count(*) FROM idem.consumed_events WHERE event_id = %s", made.event_id)
    return rows == 1 and n == 1


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1))


# ----------------------------------------------------------------------------- message cases


@pytest.mark.parametrize("case", params(MESSAGE_CASES))
def test_hostile_message(case, stage, broker, print_logs_on_failure):
    profile = case.get("consumer", "shared")
    if profile == "small_stack" and not os.path.exists("/bin/bash"):
        pytest.skip("needs bash for ulimit")
    c = stage.consumer(profile)
    try:
        run_case(case, stage, broker, c, profile)
    finally:
        stage.done_with(c)


def run_case(case, stage, broker, c, profile):
    expect = case["expect"]
    repeat = case.get("repeat", 1)
    before_reconnects = reconnects(c)
    before_dl = {}
    codes = expect.get("dead_letter")
    if isinstance(codes, str):
        codes = [codes]
    for code in codes or ():
        before_dl[code] = c.metric("idem_consumer_dead_lettered_total", code=code)

    made = [Made(case, i) for i in range(repeat)]
    started = time.monotonic()
    for m in made:
        m.publish(broker, c.queue)
        if repeat > 1:
            m.body_digest = hashlib.sha256(m.body).hexdigest()
            m.body_len = len(m.body)
            m.body = None  # 64 MiB each: keep the digest only
    # The deadline runs from the last publish; a repeated case has WITHIN seconds per message.
    deadline = WITHIN * repeat

    problems = []
    if codes:
        def arrived():
            stage.collect(c.queue)
            return all(m.name in stage.letters or m.event_id in stage.letters for m in made)
        try:
            wait_until(arrived, deadline, 0.1, f"{case['name']} in {c.queue}.dlq")
        except AssertionError as e:
            problems.append(str(e))
        for m in made:
            d = stage.letters.get(m.name) or stage.letters.get(m.event_id)
            if d is None:
                continue
            err, utf8 = error_of(d)
            if not utf8:
                problems.append(f"{m.name}: x-idem-error is not UTF-8: {raw_header(d, 'x-idem-error')!r}")
            code = err.split(":", 1)[0]
            if code not in codes or not err.startswith(code + ": ") or len(err) <= len(code) + 2:
                problems.append(f"{m.name}: x-idem-error {err!r}, want one of {codes} with a detail")
            if m.body is not None and d.body != m.body:
                problems.append(f"{m.name}: body changed ({len(d.body)} bytes, sent {len(m.body)})")
            if m.body is None and (len(d.body) != m.body_len
                                   or hashlib.sha256(d.body).hexdigest() != m.body_digest):
                problems.append(f"{m.name}: body changed ({len(d.body)} bytes, sent {m.body_len})")
            problems += check_copy(case.get("copy"), d, m)
        got = sum(c.metric("idem_consumer_dead_lettered_total", code=k) - before_dl[k]
                  for k in codes)
        if got != repeat:
            problems.append(f"idem_consumer_dead_lettered_total{{code in {codes}}} rose by {got},"
                            f" want {repeat}")
    else:
        sql = profile == "sql"
        try:
            wait_until(lambda: all(applied_once(stage.db, m, sql) for m in made), deadline, 0.1,
                       f"{case['name']} applied once")
        except AssertionError as e:
            stage.collect(c.queue)
            d = stage.letters.get(made[0].name)
            problems.append(f"{e}; in the DLQ: {error_of(d)[0] if d else None!r}")
    elapsed = time.monotonic() - started

    # The consumer is alive, did not reconnect because of the case, and a good event flows.
    if not c.running():
        problems.append(f"the consumer died (exit {c.proc.returncode})")
    else:
        canary = Made({"name": case["name"] + ".canary", "message": {}})
        canary.publish(broker, c.queue)
        try:
            wait_until(lambda: applied_once(stage.db, canary, profile == "sql"), WITHIN, 0.1,
                       "a good event after the case applied")
        except AssertionError as e:
            problems.append(str(e))
        now_reconnects = reconnects(c)
        if now_reconnects != before_reconnects:
            problems.append(f"idem_reconnects_total went {before_reconnects} -> {now_reconnects}")
        if "max_vmhwm_kib" in case:
            hwm = vm_hwm_kib(c.proc.pid)
            print(f"{case['name']}: consumer VmHWM {hwm} kB after {repeat} messages"
                  f" in {elapsed:.1f} s")
            if hwm > case["max_vmhwm_kib"]:
                problems.append(f"consumer VmHWM {hwm} kB > {case['max_vmhwm_kib']} kB")
    assert problems == [], "\n".join(problems)


def check_copy(want, d, m):
    """What the dead-letter copy must show beyond code and body (the case's "copy")."""
    if not want:
        return []
    out = []
    if "user_id" in want and d.props.user_id != want["user_id"]:
        out.append(f"{m.name}: copy user_id {d.props.user_id!r}, want {want['user_id']!r}")
    if "expiration" in want and d.props.expiration != want["expiration"]:
        out.append(f"{m.name}: copy expiration {d.props.expiration!r}, want {want['expiration']!r}")
    if "delivery_mode" in want and d.props.delivery_mode != want["delivery_mode"]:
        out.append(f"{m.name}: copy delivery_mode {d.props.delivery_mode!r}")
    for k, v in (want.get("headers") or {}).items():
        got = raw_header(d, k)
        got = got.decode(errors="replace") if isinstance(got, bytes) else got
        if got != v:
            out.append(f"{m.name}: copy header {k}={got!r}, want {v!r}")
    if "dropped" in want:
        dropped = raw_header(d, "x-idem-dropped-headers") or b""
        dropped = dropped.decode(errors="replace") if isinstance(dropped, bytes) else dropped
        if want["dropped"] not in dropped.split(","):
            out.append(f"{m.name}: x-idem-dropped-headers {dropped!r} does not name {want['dropped']}")
    return out


# ----------------------------------------------------------------------------- outbox poison rows


@pytest.mark.slow
def test_hostile_outbox_rows_park_alone(db, servers, queue, broker, tmp_path, request):
    """Every poison row of tests/hostile/outbox-*.json among 40 good rows of 8 subscriptions:
    each poison row parks `failed` at max attempts with a last_error saying why; every good row
    is sent and reaches the queue; the relay keeps running."""
    from ops_helpers import Relay, value
    from relay_helpers import declare_consumer_queue, emit_many, outbox, read_queue, status_counts

    assert len(OUTBOX_CASES) >= 5
    declare_consumer_queue(broker, queue, [PF])
    subs = [new_id() for _ in range(8)]

    def good(tag, n):
        return emit_many(db, [(PF, subs[i % 8], f"{tag}:{i}:{new_id()}",
                               {"invoice_id": new_id(), "subscription_id": subs[i % 8],
                                "amount_cents": 1, "currency": "USD", "n": i})
                              for i in range(n)])

    good_ids = good("before", 20)
    bad = {}
    for case in OUTBOX_CASES:
        r = case["row"]
        bad[case["name"]] = db.scalar(
            "INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload, headers)"
            f" VALUES (gen_random_uuid(), %s, {r['event_type_sql']},"
            f" {r.get('payload_sql', '%s::jsonb')}, {r['headers_sql']}) RETURNING event_id::text",
            new_id(), *([] if "payload_sql" in r else [json.dumps(
                {"invoice_id": new_id(), "subscription_id": subs[0], "amount_cents": 1,
                 "currency": "USD"})]))
    good_ids += good("after", 20)

    relay = Relay(db, servers, str(tmp_path), ("--max-attempts", "3", "--backoff-base", "100ms",
                                               "--backoff-max", "500ms"))
    try:
        relay.start()
        wait_until(lambda: all(outbox(db, "event_id = %s", i)[i]["status"] == "failed"
                               for i in bad.values()), 90, 0.2,
                   lambda: f"every poison row parked (now {status_counts(db)})\n{relay.log()[-3000:]}")
        wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == len(good_ids), 15, 0.2,
                   lambda: f"{len(good_ids)} good rows sent (now {status_counts(db)})")
        rows = outbox(db)
        problems = []
        for case in OUTBOX_CASES:
            b = rows[bad[case["name"]]]
            if (b["status"], b["attempts"]) != ("failed", 3):
                problems.append(f"{case['name']}: {b}")
            print(f"{case['name']}: {b['status']} after {b['attempts']} attempts:"
                  f" {(b['last_error'] or '')[:160]}")
            why = case["expect"]["last_error_any"]
            if not any(w in (b["last_error"] or "") for w in why):
                problems.append(f"{case['name']}: last_error {b['last_error']!r} names none of {why}")
        for i in good_ids:
            if rows[i]["status"] != "sent":
                problems.append(f"good row {i}: {rows[i]}")
        got = {m.event_id for m in read_queue(broker, queue, expect=len(good_ids), timeout=10,
                                              idle=1.0)}
        if not set(good_ids) <= got:
            problems.append(f"{len(set(good_ids) - got)} good events missing from the queue")
        if got & set(bad.values()):
            problems.append(f"poison rows reached the queue: {got & set(bad.values())}")
        m = relay.metrics()
        if value(m, "idem_relay_parked_total") != len(bad):
            problems.append(f"idem_relay_parked_total {value(m, 'idem_relay_parked_total')}")
        if not relay.running():
            problems.append("the relay died")
        assert problems == [], "\n".join(problems) + "\n" + relay.log()[-3000:]
        assert relay.stop() == 0
    finally:
        finish_daemons([relay], request)


# ----------------------------------------------------------------------------- the operator's view


def test_dlq_list_json_survives_hostile_copies(stage, broker, print_logs_on_failure):
    """Hostile messages end in QUEUE.dlq, where operators look at them: `idem dlq list --json`
    must still print a JSON list naming every copy (here a good-looking one and two whose
    message_id or type is not UTF-8), or fail loudly; never print nothing with exit 0."""
    from conftest import run_idem
    c = stage.consumer("isolated")
    try:
        cases = [
            {"name": "dlq-plain", "message": {"body": {"text": "{not json"}}},
            {"name": "dlq-type", "message": {"properties": {"type": {"$b64": "//6AcGF5"}}}},
            {"name": "dlq-id", "message": {"properties": {"message_id": {"$b64": "/////w=="}}}},
        ]
        made = [Made(k) for k in cases]
        for m in made:
            m.publish(broker, c.queue)
        wait_until(lambda: broker.queue_info(c.queue + ".dlq")[0] >= len(made), WITHIN, 0.1,
                   "three copies in the DLQ")
        r = run_idem("dlq", "list", "--queue", c.queue, "--json", pg_url=stage.db.url,
                     amqp_url=stage.servers.amqp_url)
        assert r.returncode != 0 or r.stdout.strip(), (
            f"exit {r.returncode} with nothing on stdout; stderr {r.stderr!r}")
        listed = json.loads(r.stdout)
        assert len(listed) == len(made), listed
    finally:
        stage.done_with(c)


def test_json_log_keeps_the_dead_letter_line(stage, broker, print_logs_on_failure):
    """With --log-format json, the warn line that says a message was dead-lettered and why must
    keep its msg (and the event_type field) whatever bytes the message's type holds."""
    c = stage.consumer("json_log")
    try:
        m = Made({"name": "json-log", "message": {"properties": {"type": {"$b64": "//6AcGF5"}}}})
        m.publish(broker, c.queue)
        wait_until(lambda: (broker.queue_info(c.queue + ".dlq") or (0,))[0] >= 1, WITHIN, 0.1,
                   "the copy in the DLQ")
        lines = [json.loads(t) for t in c.log().splitlines() if t.startswith("{")]
        ours = [x for x in lines if x.get("event_id") == m.event_id]
        assert ours, f"no log line names {m.event_id}: {lines[-5:]}"
        for x in ours:
            assert "msg" in x and "event_type" in x, f"a field vanished: {x}"
            assert "unknown_type" in x["msg"], x
    finally:
        stage.done_with(c)


def test_dlq_list_survives_an_empty_header_name(stage, broker):
    """A copy can reach QUEUE.dlq without idem (the broker dead-letters an expired message
    there): `idem dlq list` must still list every copy when one has a header with an empty
    name (valid AMQP, passed on by RabbitMQ)."""
    from conftest import run_idem
    q = stage.new_queue("dlq_empty_name")
    with broker.channel() as ch:
        ch.queue_declare(queue=q + ".dlq", durable=True)
    for headers in ({"x-idem-error": "malformed_json: a"},
                    {"x-idem-error": "malformed_json: b", "": "empty name"}):
        broker.to_queue(q + ".dlq", b"{not json", message_id=new_id(), type=PF, headers=headers,
                        timestamp=int(time.time()))
    r = run_idem("dlq", "list", "--queue", q, "--json", pg_url=stage.db.url,
                 amqp_url=stage.servers.amqp_url)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 2, r.stdout


def test_requeue_count_does_not_wrap(stage, broker):
    """x-idem-requeued is whatever the copy carries: `idem dlq requeue` must not overflow it."""
    from conftest import run_idem
    q = stage.new_queue("requeue_wrap")
    with broker.channel() as ch:
        ch.queue_declare(queue=q + ".dlq", durable=True)
        ch.queue_declare(queue=q, durable=True)
    eid = new_id()
    broker.to_queue(q + ".dlq", b"{}", message_id=eid, type=PF, timestamp=int(time.time()),
                    headers={"x-idem-error": "malformed_json: x", "x-idem-requeued": 2 ** 63 - 1})
    r = run_idem("dlq", "requeue", "--queue", q, "--all", pg_url=stage.db.url,
                 amqp_url=stage.servers.amqp_url)
    assert r.returncode == 0, r.stderr
    [d] = broker.get_all(q)
    n = d.headers.get("x-idem-requeued")
    assert n is not None and 0 < n <= 2 ** 63 - 1, f"x-idem-requeued became {n}"
