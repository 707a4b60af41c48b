"""Helpers for the outbox and relay tests (test_outbox_atomicity, test_relay_*, test_end_to_end).

Builds on conftest.py (servers, db, broker, queues, consumers, run_idem, wait_until): emitting
through idem_emit, declaring a consumer's queue exactly as `idem consume` does, reading a queue
whole, `idem relay --once` runs and relay daemons with debug logs in files (printed when a test
fails)."""

import hashlib
import json
import time
import uuid

import pytest

from conftest import EXCHANGE, IDEM, Daemon, finish_daemons, run_idem, wait_until

# ----------------------------------------------------------------------------- ids and emitting


def md5_uuid(key):
    """What idem_emit derives from a dedup key: md5(key)::uuid, canonical lowercase."""
    return str(uuid.UUID(hashlib.md5(key.encode()).hexdigest()))


def emit(db, event_type, subscription_id, key, body, conn=None):
    """SELECT idem.idem_emit(...) in its own transaction (or on conn as it is); returns the id."""
    sql = "SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb)::text"
    args = (event_type, subscription_id, key, json.dumps(body))
    if conn is not None:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchone()[0]
    return db.scalar(sql, *args)


def emit_many(db, events, per_tx=100):
    """events: [(event_type, subscription_id, key, body)], emitted in this order on one
    connection, per_tx events per transaction. Returns the ids in the same order."""
    ids = []
    with db.connect(autocommit=False) as conn:
        for i in range(0, len(events), per_tx):
            for ev in events[i:i + per_tx]:
                ids.append(emit(db, *ev, conn=conn))
            conn.commit()
    return ids


# Rows written straight into the outbox, as a backlog (no idem_emit): n rows of the given status,
# round the subscriptions subs in seq order (row i: subs[i % len(subs)]).
OUTBOX_ROWS = """
INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload, status, sent_at)
SELECT gen_random_uuid(), (%(subs)s::uuid[])[1 + i %% %(nsubs)s], %(type)s,
       jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id',
                          (%(subs)s::uuid[])[1 + i %% %(nsubs)s], 'amount_cents', 100,
                          'currency', 'USD', 'n', i),
       %(status)s, CASE WHEN %(status)s = 'sent' THEN now() END
  FROM generate_series(1, %(n)s) AS i ORDER BY i"""


def insert_rows(db, subs, event_type, status, n, cur=None):
    args = {"subs": subs, "nsubs": len(subs), "type": event_type, "status": status, "n": n}
    if cur is not None:
        cur.execute(OUTBOX_ROWS, args)
        return
    with db.connect() as conn, conn.cursor() as c:
        c.execute(OUTBOX_ROWS, args)


def outbox(db, where="true", *params):
    """{event_id: {status, attempts, last_error, subscription_id, event_type, n, seq}}."""
    rows = db.query(
        "SELECT event_id::text, status, attempts, last_error, subscription_id::text, event_type,"
        " (payload->>'n')::int, seq, sent_at FROM idem.event_outbox WHERE " + where, *params)
    keys = ("status", "attempts", "last_error", "subscription_id", "event_type", "n", "seq",
            "sent_at")
    return {r[0]: dict(zip(keys, r[1:])) for r in rows}


def status_counts(db):
    return dict(db.query("SELECT status, count(*) FROM idem.event_outbox GROUP BY status"))


def wait_all_sent(db, n, timeout=20, what=None):
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == n, timeout, 0.1,
               what or (lambda: f"{n} rows sent (now {status_counts(db)})"))


# ----------------------------------------------------------------------------- broker


def queue_args(queue):
    """The arguments `idem consume` declares QUEUE with (src/adapters/rmq/rmq.c,
    src/consumer/consumer.c)."""
    return {"x-queue-type": "quorum", "x-single-active-consumer": True,
            "x-dead-letter-exchange": queue + ".dlx",
            "x-dead-letter-routing-key": queue + ".dlq"}


def declare_consumer_queue(broker, queue, keys):
    """Declares QUEUE.dlq and QUEUE exactly as `idem consume` would (durable; QUEUE a quorum
    queue dead-lettering to QUEUE.dlq) and binds QUEUE to the exchange for each routing key, so
    that a consumer started later on QUEUE finds it compatible."""
    with broker.channel() as ch:
        broker.declare_exchange(ch)
        ch.queue_declare(queue=queue + ".dlq", durable=True)
        ch.queue_declare(queue=queue, durable=True, arguments=queue_args(queue))
        for k in keys:
            ch.queue_bind(queue=queue, exchange=EXCHANGE, routing_key=k)


def bind(broker, queue, key):
    with broker.channel() as ch:
        ch.queue_bind(queue=queue, exchange=EXCHANGE, routing_key=key)


class Msg:
    """One message read off a queue: properties, headers (as str) and the decoded body."""

    def __init__(self, method, props, body):
        self.method = method
        self.props = props
        self.raw = body
        self.headers = {k: (v.decode() if isinstance(v, bytes) else v)
                        for k, v in (props.headers or {}).items()}
        try:
            self.body = json.loads(body)
        except ValueError:
            self.body = None

    @property
    def event_id(self):
        return self.props.message_id

    @property
    def sub(self):
        return self.headers.get("subscription_id")

    @property
    def n(self):
        return self.body.get("n") if isinstance(self.body, dict) else None

    def __repr__(self):
        return f"Msg({self.props.type} {self.event_id} sub={self.sub} n={self.n})"


def read_queue(broker, queue, expect=0, timeout=20, idle=0.5):
    """Takes every message off queue (auto-ack) in queue order: waits for at least `expect`
    messages (up to timeout), then reads on until the queue has been idle for `idle` seconds, so
    that extra messages (duplicates) are read too."""
    out = []
    deadline = time.monotonic() + timeout
    with broker.channel() as ch:
        ch.basic_qos(prefetch_count=1000)
        for method, props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=idle):
            if method is None:
                if len(out) >= expect or time.monotonic() >= deadline:
                    break
                continue
            out.append(Msg(method, props, body))
        ch.cancel()
    return out


# ----------------------------------------------------------------------------- the relay


def idem(db, servers, *args, env=None, timeout=60):
    return run_idem(*args, pg_url=db.url, amqp_url=servers.amqp_url, env=env, timeout=timeout)


def relay_once(db, servers, *args, fault=None, timeout=60):
    """`idem relay --once --log-level debug ARGS...` (IDEM_FAULT=fault when given)."""
    env = {"IDEM_FAULT": fault} if fault else None
    return idem(db, servers, "relay", "--once", "--log-level", "debug", *args, env=env,
                timeout=timeout)


class RelayDaemon(Daemon):
    """A running `idem relay` (daemon, --log-level debug) with its log in a file."""

    def __init__(self, db, servers, workdir, args=(), fault=None, name="relay"):
        super().__init__(name, [IDEM, "relay", "--log-level", "debug", *args], db, servers,
                         workdir, fault)

    def start(self, wait_ready=False, timeout=15):
        self.spawn()
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout=15):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                     f"{self.log()[-3000:]}")
            log = self.log()
            return "connected to PostgreSQL" in log and "connected to RabbitMQ" in log

        wait_until(ready, timeout, 0.05, f"{self.name} connected to both servers")

    def batch_lines(self):
        """The 'batch committed' debug lines, each as {key: int} (claimed, sent, claim_ms, ...)."""
        out = []
        for line in self.log().splitlines():
            if "batch committed" not in line:
                continue
            kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
            out.append({k: int(v) for k, v in kv.items() if v.isdigit()})
        return out

    def batches(self):
        """[(claimed, sent)] of the 'batch committed' debug lines."""
        return [(b.get("claimed", 0), b.get("sent", 0)) for b in self.batch_lines()]

    def sent(self):
        return sum(s for _, s in self.batches())


@pytest.fixture
def relay_daemons(db, servers, tmp_path, request):
    """Factory: relay_daemons(args=[...], fault=None, name='relay', start=True) -> RelayDaemon.
    All are stopped after the test; their logs are printed when the test failed."""
    made = []

    def make(args=(), fault=None, name=None, start=True, wait_ready=False):
        r = RelayDaemon(db, servers, str(tmp_path), args, fault, name or f"relay{len(made) + 1}")
        made.append(r)
        if start:
            r.start(wait_ready=wait_ready)
        return r

    yield make
    finish_daemons(made, request)


__all__ = ["md5_uuid", "emit", "emit_many", "insert_rows", "outbox", "status_counts", "wait_all_sent",
           "queue_args", "declare_consumer_queue", "bind", "Msg", "read_queue", "idem",
           "relay_once", "RelayDaemon", "relay_daemons"]
