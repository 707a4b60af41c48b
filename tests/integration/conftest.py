"""Fixtures and helpers for idem's integration tests (real PostgreSQL and RabbitMQ).

Run with Debian's interpreter (it has pika and psycopg2):  /usr/bin/python3 -m pytest tests/integration

Servers: if IDEM_PG_URL and IDEM_AMQP_URL are set, they are used as they are (IDEM_SVC_DIR, when
set too, lets the restart tests stop and start them through scripts/services.sh); otherwise one
private pair is started for the session with scripts/services.sh and stopped at the end.

Every test gets its own database, copied from a template that `build/idem migrate` prepared once,
and its own queue names; the exchange is the contract's default, billing.events.
"""

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
import uuid

import pika
import psycopg2
import psycopg2.extras
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IDEM = os.environ.get("IDEM_BIN", os.path.join(REPO, "build", "idem"))
SERVICES = os.path.join(REPO, "scripts", "services.sh")
EXCHANGE = "billing.events"
USD = "USD"

# ----------------------------------------------------------------------------- generic helpers


def wait_until(pred, timeout=15.0, interval=0.05, what="condition"):
    """Polls pred() until it returns a truthy value, which is returned; fails after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= deadline:
            what = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_id():
    return str(uuid.uuid4())


def payload(subscription_id=None, invoice_id=None, amount_cents=1250, currency=USD, **extra):
    p = {
        "invoice_id": invoice_id or new_id(),
        "subscription_id": subscription_id or new_id(),
        "amount_cents": amount_cents,
        "currency": currency,
    }
    p.update(extra)
    return p


_libc = ctypes.CDLL("libc.so.6", use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # A daemon started by a test must not outlive pytest, whatever kills pytest.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _sigterm_as_interrupt(signum, frame):
    # services.sh `with` forwards SIGTERM: tear fixtures down (servers, daemons) like on Ctrl-C.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt("SIGTERM")


signal.signal(signal.SIGTERM, _sigterm_as_interrupt)

# ----------------------------------------------------------------------------- servers


class Servers:
    def __init__(self, pg_url, amqp_url, svc_dir):
        self.pg_url = pg_url
        self.amqp_url = amqp_url
        self.svc_dir = svc_dir  # None when the servers are not ours to restart

    def services(self, *args, timeout=120):
        if not self.svc_dir:
            pytest.skip("needs servers started by scripts/services.sh (IDEM_SVC_DIR)")
        r = subprocess.run([SERVICES, *args[:1], self.svc_dir, *args[1:]], capture_output=True,
                           text=True, timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"services.sh {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r.stdout

    def pg_stop(self):
        self.services("pg-stop")

    def pg_start(self):
        self.services("pg-start")

    def rmq_stop(self):
        self.services("rmq-stop")

    def rmq_start(self):
        self.services("rmq-start")

    def rmqctl(self, *args):
        return self.services("rmqctl", *args)

    def queue_counts(self, queue):
        """(messages, unacked) of queue as the broker counts them (messages includes unacked),
        or None if there is no such queue. Slow (a CLI call, ~0.5 s)."""
        out = self.rmqctl("-q", "list_queues", "name", "messages", "messages_unacknowledged",
                          "--no-table-headers")
        for line in out.splitlines():
            f = line.split()
            if len(f) == 3 and f[0] == queue:
                return int(f[1]), int(f[2])
        return None

    def db_url(self, dbname):
        u = urllib.parse.urlsplit(self.pg_url)
        return urllib.parse.urlunsplit(u._replace(path="/" + dbname))


@pytest.fixture(scope="session")
def servers():
    pg, amqp = os.environ.get("IDEM_PG_URL"), os.environ.get("IDEM_AMQP_URL")
    if pg and amqp:
        yield Servers(pg, amqp, os.environ.get("IDEM_SVC_DIR") or None)
        return
    d = tempfile.mkdtemp(prefix="idem-pytest.")
    try:
        r = subprocess.run([SERVICES, "start", d], stdout=subprocess.PIPE, text=True, timeout=180)
        if r.returncode != 0:
            pytest.fail(f"scripts/services.sh start failed ({r.returncode}); see stderr above")
        env = {}
        with open(r.stdout.strip()) as f:
            for word in f.read().split():
                if "=" in word:
                    k, v = word.split("=", 1)
                    env[k] = v
        yield Servers(env["IDEM_PG_URL"], env["IDEM_AMQP_URL"], d)
    finally:
        subprocess.run([SERVICES, "stop", d], timeout=120)
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- PostgreSQL


def admin_exec(servers, sql):
    conn = psycopg2.connect(servers.db_url("postgres"))
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


def run_idem(*args, pg_url=None, amqp_url=None, env=None, timeout=60):
    """Runs build/idem ARGS... and returns the CompletedProcess (text stdout/stderr)."""
    e = dict(os.environ)
    e.pop("IDEM_FAULT", None)
    if pg_url is not None:
        e["IDEM_PG_URL"] = pg_url
    if amqp_url is not None:
        e["IDEM_AMQP_URL"] = amqp_url
    if env:
        e.update(env)
    return subprocess.run([IDEM, *args], capture_output=True, text=True, env=e, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def template_db(servers):
    """A database migrated once by `idem migrate`; each test's database is a copy of it."""
    if not os.access(IDEM, os.X_OK):
        pytest.fail(f"{IDEM} is missing: run make first")
    name = f"idem_tpl_{os.getpid()}"
    admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}"')
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    r = run_idem("migrate", pg_url=servers.db_url(name), amqp_url=servers.amqp_url)
    if r.returncode != 0:
        pytest.fail(f"idem migrate into the template failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    yield name
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Db:
    def __init__(self, url):
        self.url = url

    @contextlib.contextmanager
    def connect(self, autocommit=True):
        conn = psycopg2.connect(self.url, connect_timeout=5)
        conn.autocommit = autocommit
        try:
            yield conn
        finally:
            conn.close()

    def query(self, sql, *params):
        """All rows, as tuples."""
        with self.connect() as conn, conn.cursor() as cur:
            cur.execute(sql, params or None)
            return cur.fetchall() if cur.description else []

    def scalar(self, sql, *params):
        rows = self.query(sql, *params)
        return rows[0][0] if rows else None

    def execute(self, sql, *params):
        with self.connect() as conn, conn.cursor() as cur:
            cur.execute(sql, params or None)

    # Bundled handlers' state.
    def dunning_step(self, subscription_id):
        return self.scalar("SELECT step FROM dunning WHERE subscription_id = %s", subscription_id)

    def ledger(self, consumer=None):
        """[(consumer, event_id)] of consumed_events, ordered."""
        if consumer is None:
            rows = self.query("SELECT consumer, event_id::text FROM consumed_events ORDER BY 1, 2")
        else:
            rows = self.query("SELECT consumer, event_id::text FROM consumed_events WHERE consumer = %s"
                              " ORDER BY 1, 2", consumer)
        return [tuple(r) for r in rows]

    def count(self, table, where="true", *params):
        return self.scalar(f"SELECT count(*) FROM {table} WHERE {where}", *params)


@pytest.fixture
def db(servers, template_db):
    """A fresh, migrated database for this test."""
    name = "t_" + uuid.uuid4().hex[:16]
    admin_exec(servers, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield Db(servers.db_url(name))
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ----------------------------------------------------------------------------- RabbitMQ


class Delivery:
    def __init__(self, method, props, body):
        self.method = method
        self.props = props
        self.body = body

    @property
    def headers(self):
        return self.props.headers or {}

    def header(self, name):
        v = self.headers.get(name)
        return v.decode() if isinstance(v, bytes) else v

    @property
    def error(self):
        return self.header("x-idem-error")

    def __repr__(self):
        return (f"Delivery(message_id={self.props.message_id!r}, type={self.props.type!r}, "
                f"headers={self.headers!r}, body={self.body[:80]!r})")


class Broker:
    def __init__(self, url):
        self.url = url

    @contextlib.contextmanager
    def channel(self):
        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 5
        params.blocked_connection_timeout = 10
        conn = pika.BlockingConnection(params)
        try:
            yield conn.channel()
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def declare_exchange(self, ch):
        ch.exchange_declare(exchange=EXCHANGE, exchange_type="topic", durable=True)

    def publish_raw(self, body, routing_key="", exchange=EXCHANGE, message_id=None, type=None,
                    headers=None, timestamp=None, content_type="application/json", delivery_mode=2,
                    mandatory=True, **props):
        """Publishes one message exactly as given (None leaves a property out) and waits for the
        broker's confirm; an unroutable message fails the test (mandatory)."""
        if isinstance(body, str):
            body = body.encode()
        p = pika.BasicProperties(message_id=message_id, type=type, headers=headers,
                                 timestamp=timestamp, content_type=content_type,
                                 delivery_mode=delivery_mode, **props)
        with self.channel() as ch:
            if exchange == EXCHANGE:
                self.declare_exchange(ch)
            ch.confirm_delivery()
            ch.basic_publish(exchange=exchange, routing_key=routing_key, body=body, properties=p,
                             mandatory=mandatory)

    def publish_event(self, event_type, body, event_id=None, timestamp="now", headers=None, **kw):
        """Publishes like the relay does; body is a dict (JSON-encoded) or bytes. Returns the id."""
        event_id = event_id or new_id()
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if timestamp == "now":
            timestamp = int(time.time())
        self.publish_raw(body, routing_key=event_type, message_id=event_id, type=event_type,
                         headers=headers, timestamp=timestamp, **kw)
        return event_id

    def to_queue(self, queue, body, **kw):
        """Publishes straight to a queue through the default exchange."""
        self.publish_raw(body, routing_key=queue, exchange="", **kw)

    def queue_info(self, queue):
        """(message_count, consumer_count), or None if the queue does not exist."""
        try:
            with self.channel() as ch:
                ok = ch.queue_declare(queue=queue, passive=True).method
                return ok.message_count, ok.consumer_count
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code == 404:
                return None
            raise

    def depth(self, queue):
        """Ready messages (unacked ones are not counted: stop the consumer first)."""
        info = self.queue_info(queue)
        return None if info is None else info[0]

    def get_all(self, queue):
        """Takes every ready message off queue (acking them)."""
        out = []
        with self.channel() as ch:
            while True:
                method, props, body = ch.basic_get(queue=queue, auto_ack=True)
                if method is None:
                    return out
                out.append(Delivery(method, props, body))

    def delete_queue(self, queue):
        with contextlib.suppress(Exception), self.channel() as ch:
            ch.queue_delete(queue=queue)


@pytest.fixture(scope="session")
def broker(servers):
    return Broker(servers.amqp_url)


class Queues:
    """Unique queue names for one test; the queues and their DLQs are deleted afterwards."""

    def __init__(self, broker, prefix):
        self.broker = broker
        self.prefix = prefix
        self.names = []

    def new(self, tag="q"):
        name = f"it.{self.prefix}.{tag}.{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        return name

    def cleanup(self):
        for q in self.names:
            self.broker.delete_queue(q)
            self.broker.delete_queue(q + ".dlq")


@pytest.fixture
def queues(broker, request):
    prefix = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40]
    q = Queues(broker, prefix)
    yield q
    q.cleanup()


@pytest.fixture
def queue(queues):
    return queues.new()


class DeadLetters:
    """Collects what reaches QUEUE.dlq (messages are taken off the queue as they are read)."""

    def __init__(self, broker, queue):
        self.broker = broker
        self.dlq = queue + ".dlq"
        self.got = []

    def poll(self):
        if self.broker.queue_info(self.dlq) is not None:
            self.got.extend(self.broker.get_all(self.dlq))
        return self.got

    def wait(self, n, timeout=15):
        wait_until(lambda: len(self.poll()) >= n, timeout, 0.1, f"{n} message(s) in {self.dlq}")
        return self.got

    def by_case(self):
        return {d.header("x-case"): d for d in self.got}


# ----------------------------------------------------------------------------- consumer daemon


class Daemon:
    """A long-running build/idem process with its output in a log file, killed if pytest dies.
    Subclasses give it its argv; start/stop/kill/log/wait_exit are shared."""

    def __init__(self, name, argv, db, servers, workdir, fault=None, env=None):
        self.name = name
        self.argv = argv
        self.env = dict(os.environ, IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url)
        self.env.pop("IDEM_FAULT", None)
        if fault:
            self.env["IDEM_FAULT"] = fault
        if env:
            self.env.update(env)
        self.logpath = os.path.join(workdir, f"{name}-{uuid.uuid4().hex[:6]}.log")
        self.proc = None
        self.logfile = None

    def spawn(self):
        assert not self.running(), "already running"
        self.logfile = open(self.logpath, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self.logfile, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        return self

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def log(self):
        try:
            with open(self.logpath, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def signal(self, sig):
        self.proc.send_signal(sig)

    def wait_exit(self, timeout=15):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s:\n"
                                 f"{self.log()[-3000:]}")

    def stop(self, timeout=15):
        """SIGTERM and wait; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait_exit(timeout)
        finally:
            self.close()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.close()

    def close(self):
        if self.logfile is not None:
            with contextlib.suppress(Exception):
                self.logfile.close()


def finish_daemons(daemons, request=None, tail=8000):
    """Fixture teardown: SIGTERM (then SIGKILL) every daemon; if the test failed, print the end
    of each one's log."""
    for d in daemons:
        if d.running():
            with contextlib.suppress(Exception):
                d.stop(10)
        d.kill()
    rep = getattr(request.node, "rep_call", None) if request is not None else None
    if rep is not None and rep.failed:
        for d in daemons:
            print(f"\n----- log of {d.name} ({d.logpath}):\n{d.log()[-tail:]}")


class Consumer(Daemon):
    """A running `idem consume` with its log in a file and metrics on a private port."""

    def __init__(self, name, queue, db, servers, broker, workdir, args=(), fault=None, env=None,
                 metrics=True):
        self.queue = queue
        self.db = db
        self.servers = servers
        self.broker = broker
        self.metrics_port = free_port() if metrics else None
        argv = [IDEM, "consume", "--consumer", name, "--queue", queue, *args]
        if self.metrics_port:
            argv += ["--metrics-port", str(self.metrics_port)]
        super().__init__(name, argv, db, servers, workdir, fault, env)
        self.logpath = os.path.join(workdir, f"consume-{name}-{uuid.uuid4().hex[:6]}.log")

    def start(self, wait_ready=True):
        self.spawn()
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout=20):
        """Ready = the queue exists and this process has a basic.consume on it (so its bindings
        are in place: publishing to the exchange reaches it)."""

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"consumer exited with {self.proc.returncode}:\n{self.log()}")
            info = self.broker.queue_info(self.queue)
            return info is not None and info[1] >= 1

        wait_until(ready, timeout, 0.1, f"consumer {self.name} consuming from {self.queue}")
        if self.metrics_port:
            wait_until(lambda: self.try_metrics() is not None, 10, 0.1, "metrics endpoint")

    # Metrics (Prometheus text).
    def try_metrics(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key.strip()] = float(value)
        return out

    def metric(self, name, **labels):
        """Sum of the samples of name whose labels include the given ones (0 if none)."""
        m = self.try_metrics()
        if m is None:
            raise AssertionError(f"no metrics from consumer {self.name}:\n{self.log()[-3000:]}")
        total = 0.0
        for key, v in m.items():
            base, _, lab = key.partition("{")
            if base != name:
                continue
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', lab))
            if all(have.get(k) == str(v2) for k, v2 in labels.items()):
                total += v
        return total

    def wait_metric(self, name, at_least, timeout=15, **labels):
        return wait_until(lambda: self.metric(name, **labels) >= at_least or None, timeout, 0.1,
                          lambda: f"{name}{labels or ''} >= {at_least} "
                          f"(now {self.metric(name, **labels)})")

    def wait_handled(self, n, timeout=15):
        """Waits until n deliveries were applied or found duplicate."""
        return wait_until(lambda: (self.metric("idem_consumer_applied_total")
                                   + self.metric("idem_consumer_duplicates_total")) >= n or None,
                          timeout, 0.1, f"{n} deliveries applied or duplicate by {self.name}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def consumers(servers, broker, tmp_path, request):
    """Factory: consumers(name, queue, db, args=[...], fault=None) -> a started Consumer.
    All are stopped (SIGTERM, then SIGKILL) after the test; their logs are printed on failure."""
    started = []

    def make(name, queue, db, args=(), fault=None, env=None, start=True, metrics=True):
        c = Consumer(name, queue, db, servers, broker, str(tmp_path), args, fault, env, metrics)
        started.append(c)
        if start:
            c.start()
        return c

    yield make
    finish_daemons(started, request)


@pytest.fixture
def dead_letters(broker):
    return lambda queue: DeadLetters(broker, queue)
