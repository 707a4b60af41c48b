"""Helpers for the scale-out tests: partitioned consumer groups (`--partitions`), a billing load
with a known per-subscription order, an audit of its effects, and the broker's view of who is the
single active consumer of each partition.

Builds on conftest.py (Consumer, Daemon, Db, wait_until) and relay_helpers.py. The pieces:

- `group_queue` fixture: a factory of queue names whose whole partitioned topology (QUEUE,
  QUEUE.p0.., QUEUE.dlq, the exchanges QUEUE.part, QUEUE.part.unkeyed and QUEUE.dlx, and an
  older idem's QUEUE.hash) is deleted after the test.
- `shard` / `partition_of`: where the contract routes a subscription (md5 of its id, mod 1024,
  mod P).
- `GroupConsumer`: an `idem consume` process that may be SIGKILLed and started again; it is
  ready when its log says it consumes (again), since a partitioned group has no queue QUEUE.
- `plan_billing` / `Emitter`: payment.failed and invoice.paid sequences per subscription, emitted
  through idem_emit in that order (paced, in a thread), optionally retrying a failed transaction
  with the same dedup key until its COMMIT is acknowledged.
- `install_effect_log` / `audit`: a trigger-fed log of every effect the bundled handlers make,
  in the order they make them, and the audit of a plan against the database: every event applied
  once, each subscription's effects in emit order, final dunning steps, revenue and receipts.
- `active_consumers`: which of our processes the broker made the active consumer of each queue
  (rabbitmqctl list_consumers/list_channels/list_connections, matched to our sockets in /proc).
"""

import contextlib
import json
import os
import random
import threading
import time
import uuid

import pika
import psycopg2
import pytest

from conftest import Consumer, wait_until

BILLING_TYPES = ("payment.failed", "invoice.paid", "receipt.requested")
MAX_PARTITIONS_CLEANED = 16

# ----------------------------------------------------------------------------- topology


def partitions(queue, p):
    return [f"{queue}.p{i}" for i in range(p)]


def shard(sub):
    """The contract's shard of a subscription: the first 4 bytes of md5(its lowercase canonical
    text), big-endian, mod 1024."""
    import hashlib
    canon = str(uuid.UUID(sub))
    return int.from_bytes(hashlib.md5(canon.encode()).digest()[:4], "big") % 1024


def partition_of(subs, p):
    """{subscription: partition index} of a group of p partitions."""
    return {s: shard(s) % p for s in subs}


def delete_topology(amqp_url, queue):
    """Deletes QUEUE, QUEUE.p0..p15, QUEUE.dlq and the exchanges QUEUE.part, QUEUE.part.unkeyed,
    QUEUE.hash and QUEUE.dlx."""
    params = pika.URLParameters(amqp_url.split(",")[0])
    params.connection_attempts = 1
    params.socket_timeout = 5
    with contextlib.suppress(Exception):
        conn = pika.BlockingConnection(params)
        try:
            ch = conn.channel()
            for q in [queue, queue + ".dlq", *partitions(queue, MAX_PARTITIONS_CLEANED)]:
                if ch.is_closed:
                    ch = conn.channel()
                with contextlib.suppress(Exception):
                    ch.queue_delete(queue=q)
            for x in (queue + ".part", queue + ".part.unkeyed", queue + ".hash", queue + ".dlx"):
                if ch.is_closed:
                    ch = conn.channel()
                with contextlib.suppress(Exception):
                    ch.exchange_delete(exchange=x)
        finally:
            with contextlib.suppress(Exception):
                conn.close()


@pytest.fixture
def group_queue(servers):
    """Factory: group_queue(tag) -> a fresh queue name; its partitioned topology on the session's
    broker is deleted after the test (pass amqp_url= for another broker)."""
    made = []

    def make(tag="g", amqp_url=None):
        name = f"it.grp.{tag}.{uuid.uuid4().hex[:8]}"
        made.append((name, amqp_url or servers.amqp_url))
        return name

    yield make
    for name, url in made:
        delete_topology(url, name)


# ----------------------------------------------------------------------------- consumers


class GroupConsumer(Consumer):
    """`idem consume` of a group: ready once its log says it consumes (one more time than
    before the last start); `restart()` after a SIGKILL starts the same command again."""

    READY = "connected to RabbitMQ, consuming"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._ready_seen = 0
        self.starts = 0

    def start(self, wait_ready=True):
        self._ready_seen = self.log().count(self.READY)
        self.starts += 1
        self.spawn()
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout=30):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                     f"{self.log()[-3000:]}")
            return self.log().count(self.READY) > self._ready_seen

        wait_until(ready, timeout, 0.05, f"{self.name} consuming")
        if self.metrics_port:
            wait_until(lambda: self.try_metrics() is not None, 10, 0.05, "metrics endpoint")

    def applied(self):
        """idem_consumer_applied_total of the running process, or None when it does not answer."""
        m = self.try_metrics() if self.running() else None
        return None if m is None else m.get("idem_consumer_applied_total", 0.0)

    def sigkill(self):
        self.proc.kill()
        self.proc.wait(10)
        self.close()


class Endpoints:
    """What a Daemon needs of `servers` (amqp_url), for a broker other than the session's."""

    def __init__(self, amqp_url, pg_url=None):
        self.amqp_url = amqp_url
        self.pg_url = pg_url


@pytest.fixture
def group_consumers(servers, broker, tmp_path, request):
    """Factory: group_consumers(name, queue, db, args, ..., amqp_url=None) -> GroupConsumer
    (started unless start=False); all are stopped after the test, logs printed on failure."""
    from conftest import finish_daemons

    made = []

    def make(name, queue, db, args=(), env=None, start=True, amqp_url=None, label=None):
        srv = Endpoints(amqp_url) if amqp_url else servers
        c = GroupConsumer(name, queue, db, srv, broker, str(tmp_path), args, None, env, True)
        if label:
            c.name = label  # the ledger name stays `name`; label tells processes apart in logs
        made.append(c)
        if start:
            c.start()
        return c

    yield make
    finish_daemons(made, request)


# ----------------------------------------------------------------------------- the broker's view


def _socket_ports(pid):
    """Local TCP ports of the sockets process pid holds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def active_consumers(rmqctl, queues, procs):
    """{queue: name of the process the broker made its active consumer, '?' for one that is not
    ours, None for none}. rmqctl(*args) runs rabbitmqctl and returns its stdout."""
    def js(*args):
        return json.loads(rmqctl("-q", *args, "--formatter", "json") or "[]")

    consumers = js("list_consumers", "queue_name", "channel_pid", "active")
    channels = {c["pid"]: c["connection"] for c in js("list_channels", "pid", "connection")}
    conns = {c["pid"]: c["peer_port"] for c in js("list_connections", "pid", "peer_port")}
    port_owner = {}
    for p in procs:
        if p.running():
            for port in _socket_ports(p.proc.pid):
                port_owner[port] = p.name
    out = {q: None for q in queues}
    for c in consumers:
        if c["queue_name"] in out and c["active"]:
            port = conns.get(channels.get(c["channel_pid"]))
            out[c["queue_name"]] = port_owner.get(port, "?")
    return out


# ----------------------------------------------------------------------------- the load


class Event:
    __slots__ = ("type", "sub", "key", "body", "id")

    def __init__(self, type_, sub, key, body, id_):
        self.type, self.sub, self.key, self.body, self.id = type_, sub, key, body, id_


def md5_uuid(key):
    import hashlib
    return str(uuid.UUID(hashlib.md5(key.encode()).hexdigest()))


def plan_billing(n_subs, per_sub, seed=1, paid_share=0.4):
    """{sub: [Event...]} with random payment.failed / invoice.paid sequences (each subscription
    starts with a failure half of the time, so invoice.paid meets both 'no row' and 'a row'),
    and the emission order: a random interleaving keeping each subscription's own order."""
    rng = random.Random(seed)
    plan = {}
    for _ in range(n_subs):
        sub = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        evs = []
        for n in range(per_sub):
            paid = rng.random() < paid_share and not (n == 0 and rng.random() < 0.5)
            t = "invoice.paid" if paid else "payment.failed"
            inv = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            key = f"{sub}:{n}:{t}"
            body = {"invoice_id": inv, "subscription_id": sub, "amount_cents": 100 + n,
                    "currency": "USD", "n": n}
            evs.append(Event(t, sub, key, body, md5_uuid(key)))
        plan[sub] = evs
    todo = {s: list(evs) for s, evs in plan.items()}
    order = []
    while todo:
        s = rng.choice(sorted(todo))
        order.append(todo[s].pop(0))
        if not todo[s]:
            del todo[s]
    return plan, order


def simulate(evs):
    """(final dunning step or None, [(event_id, step after or None)]) of applying evs in order:
    payment.failed step+1 (row created at 1); invoice.paid step 0 if a row exists."""
    step, hist = None, []
    for e in evs:
        if e.type == "payment.failed":
            step = 1 if step is None else step + 1
        elif step is not None:
            step = 0
        hist.append((e.id, step))
    return step, hist


class Emitter(threading.Thread):
    """Emits events through idem_emit in the given order, per_tx per transaction, paced at rate
    events/s. With retry=True a transaction that fails (connection lost, server read-only) is
    retried with the same dedup keys until its COMMIT is acknowledged, so the emission order per
    subscription is kept; otherwise the first error ends the thread (self.error).

    acked: ids whose transaction got a COMMIT acknowledgement; in_doubt: ids whose COMMIT was
    sent but not acknowledged at least once; failures: errors seen."""

    def __init__(self, url, events, rate=200.0, per_tx=5, retry=False, connect_timeout=3,
                 fn="idem.idem_emit"):
        super().__init__(daemon=True)
        self.url, self.events, self.rate, self.per_tx = url, events, rate, per_tx
        self.fn = fn  # the function called (schema-qualified, or found on the URL's search_path)
        self.retry, self.connect_timeout = retry, connect_timeout
        self.acked, self.in_doubt, self.failures = [], set(), []
        self.error = None
        self.stop_flag = threading.Event()
        self.done_at = None
        self.progress = 0

    def _connect(self):
        conn = psycopg2.connect(self.url, connect_timeout=self.connect_timeout)
        conn.autocommit = False
        return conn

    def run(self):
        conn = None
        t0 = time.monotonic()
        try:
            i = 0
            while i < len(self.events) and not self.stop_flag.is_set():
                chunk = self.events[i:i + self.per_tx]
                # a transaction emitting for several subscriptions takes their locks in one
                # global order (the consumers' batches take them sorted too), as the README asks
                ordered = sorted(chunk, key=lambda e: e.sub)
                due = t0 + i / self.rate
                time.sleep(max(0.0, due - time.monotonic()))
                committing = False
                try:
                    if conn is None or conn.closed:
                        conn = self._connect()
                    with conn.cursor() as cur:
                        for e in ordered:
                            cur.execute(f"SELECT {self.fn}(%s, %s::uuid, %s, %s::jsonb)::text",
                                        (e.type, e.sub, e.key, json.dumps(e.body)))
                            got = cur.fetchone()[0]
                            assert got == e.id, f"idem_emit returned {got} for {e.key}"
                    committing = True
                    conn.commit()
                except psycopg2.Error as exc:
                    if committing:
                        self.in_doubt.update(e.id for e in chunk)
                    self.failures.append(f"{type(exc).__name__}: {str(exc).strip()[:200]}")
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                    # a deadlock or serialization failure is retried as any application would
                    if not self.retry and exc.pgcode not in ("40P01", "40001"):
                        raise
                    time.sleep(0.1)
                    continue
                self.acked.extend(e.id for e in chunk)
                i += len(chunk)
                self.progress = i
        except Exception as exc:  # reported by the test through self.error
            self.error = exc
        finally:
            self.done_at = time.time()
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def finish(self, timeout=120):
        self.join(timeout)
        assert not self.is_alive(), "the emitter did not finish"
        assert self.error is None, f"emitting failed: {self.error!r}"


# ----------------------------------------------------------------------------- the audit

EFFECT_LOG_SQL = """
CREATE TABLE it_effects (
    n               bigserial PRIMARY KEY,
    kind            text NOT NULL,
    subscription_id uuid,
    event_id        uuid,
    step            int,
    at              timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION it_log_dunning() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO it_effects (kind, subscription_id, event_id, step)
    VALUES ('dunning', NEW.subscription_id, NEW.last_event_id, NEW.step);
    RETURN NULL;
END $$;
CREATE FUNCTION it_log_revenue() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO it_effects (kind, subscription_id, event_id) VALUES ('revenue', NEW.subscription_id,
                                                                     NEW.event_id);
    RETURN NULL;
END $$;
CREATE TRIGGER it_log_dunning AFTER INSERT OR UPDATE ON billing.dunning
    FOR EACH ROW EXECUTE FUNCTION it_log_dunning();
CREATE TRIGGER it_log_revenue AFTER INSERT ON billing.revenue_entries
    FOR EACH ROW EXECUTE FUNCTION it_log_revenue();
"""


def install_effect_log(conn_or_db, schema="billing"):
    """Adds it_effects and the triggers that fill it (test-only objects, in the test's database):
    every dunning change (with the event that made it) and revenue entry, in the order made.
    schema: where the handlers' tables are (public in a database of an older idem)."""
    sql = EFFECT_LOG_SQL.replace(" ON billing.", f" ON {schema}.")
    if hasattr(conn_or_db, "execute"):
        conn_or_db.execute(sql)
    else:
        with conn_or_db.cursor() as cur:
            cur.execute(sql)


def audit(query, plan, consumer="billing", only=None):
    """Checks the effects of plan ({sub: [Event]}) in the database; query(sql, *params) returns
    rows. only: a set of event ids to hold to (the others must not have taken effect at all);
    None = every event of the plan. Returns a summary dict. Fails with the first difference:
      - every event of plan (and the receipt.requested of each paid invoice) has its ledger row;
      - each subscription's effects happened in emit order, each event's once (it_effects);
      - each subscription's final dunning step is the one of applying its events in order;
      - one revenue entry and one receipt per paid invoice; nothing else in those tables."""
    evs_of = {s: [e for e in evs if only is None or e.id in only] for s, evs in plan.items()}
    want = [e for evs in evs_of.values() for e in evs]
    paid = [e for e in want if e.type == "invoice.paid"]
    ledger = {r[0] for r in query(
        "SELECT event_id::text FROM idem.consumed_events WHERE consumer = %s", consumer)}
    # a paid invoice's receipt is its follow-up (key idem:<event id>:receipt), or the key
    # <invoice_id>:receipt when an older idem applied the invoice.paid
    receipts = set()
    for e in paid:
        new, old = md5_uuid(f"idem:{e.id}:receipt"), md5_uuid(f"{e.body['invoice_id']}:receipt")
        receipts.add(old if old in ledger and new not in ledger else new)
    missing = [e.id for e in want if e.id not in ledger]
    assert not missing, f"{len(missing)} events never applied, e.g. {missing[:3]}"
    missing_r = receipts - ledger
    assert not missing_r, f"{len(missing_r)} receipts never applied, e.g. {sorted(missing_r)[:3]}"
    extra = ledger - {e.id for e in want} - receipts
    if only is not None:
        all_ids = {e.id for evs in plan.values() for e in evs}
        assert not (extra & all_ids), f"events not committed by the emitter took effect: {extra}"

    effects = {}
    for sub, eid, kind, step in query(
            "SELECT subscription_id::text, event_id::text, kind, step FROM it_effects ORDER BY n"):
        effects.setdefault(sub, []).append((eid, kind, step))
    bad = []
    for sub, evs in evs_of.items():
        final, hist = simulate(evs)
        seen = effects.get(sub, [])
        # one event's statement may log two effects (invoice.paid: revenue, then the reset)
        order = []
        for eid, _, _ in seen:
            if not order or order[-1] != eid:
                order.append(eid)
        counts = {}
        for eid, kind, _ in seen:
            counts[(eid, kind)] = counts.get((eid, kind), 0) + 1
        steps = {eid: step for eid, kind, step in seen if kind == "dunning"}
        expect_order = [e.id for e in evs]
        problems = []
        if order != expect_order:
            pos = {e.id: (i, e.type) for i, e in enumerate(evs)}
            problems.append("effects in order " + str([pos.get(x, ("?", x)) for x in order]))
        for e, (_, after) in zip(evs, hist):
            if e.type == "payment.failed":
                if counts.get((e.id, "dunning"), 0) != 1 or steps.get(e.id) != after:
                    problems.append(f"payment.failed #{e.body['n']}: dunning changes "
                                    f"{counts.get((e.id, 'dunning'), 0)}, step {steps.get(e.id)}"
                                    f" (want 1, {after})")
            else:
                if counts.get((e.id, "revenue"), 0) != 1:
                    problems.append(f"invoice.paid #{e.body['n']}: "
                                    f"{counts.get((e.id, 'revenue'), 0)} revenue entries")
                resets = counts.get((e.id, "dunning"), 0)
                if resets != (0 if after is None else 1):
                    problems.append(f"invoice.paid #{e.body['n']}: {resets} dunning resets")
        got = query("SELECT step FROM billing.dunning WHERE subscription_id = %s", sub)
        got = got[0][0] if got else None
        if got != final:
            problems.append(f"final step {got}, want {final}")
        if problems:
            bad.append(f"{sub}: " + "; ".join(problems[:4]))
    assert not bad, f"{len(bad)} subscriptions wrong:\n" + "\n".join(bad[:10])

    rev = {r[0]: r[1] for r in query(
        "SELECT event_id::text, count(*) FROM billing.revenue_entries GROUP BY 1")}
    assert rev == {e.id: 1 for e in paid}, "revenue entries are not one per paid invoice"
    rec = {r[0]: r[1] for r in query(
        "SELECT invoice_id::text, count(*) FROM billing.receipts GROUP BY 1")}
    assert rec == {e.body["invoice_id"]: 1 for e in paid}, "receipts are not one per paid invoice"
    return {"events": len(want), "paid": len(paid), "ledger_rows": len(ledger),
            "subscriptions": len(evs_of)}


def takeover_seconds(query, kill_at, subs_by_partition):
    """For a process SIGKILLed at kill_at (epoch seconds): per partition, the time from the kill
    to the first effect of one of its subscriptions after it. The largest is the takeover of the
    partitions the process was active on (the others flow on). None for a partition with no
    effect after the kill."""
    out = {}
    for p, subs in subs_by_partition.items():
        first = query("SELECT extract(epoch FROM min(at))::float8 FROM it_effects "
                      "WHERE at > to_timestamp(%s) AND subscription_id = ANY(%s::uuid[])",
                      kill_at, list(subs))[0][0]
        out[p] = None if first is None else first - kill_at
    return out


__all__ = ["BILLING_TYPES", "partitions", "shard", "delete_topology", "group_queue", "GroupConsumer",
           "Endpoints", "group_consumers", "active_consumers", "partition_of", "Event",
           "md5_uuid", "plan_billing", "simulate", "Emitter", "install_effect_log", "audit",
           "takeover_seconds"]
