"""Fixtures and helpers for idem's integration tests (real PostgreSQL and RabbitMQ).

Run with Debian's interpreter (it has pika and psycopg2):  /usr/bin/python3 -m pytest tests/integration

Servers: if IDEM_PG_URL and IDEM_AMQP_URL are set, they are used as they are (IDEM_SVC_DIR, when
set too, lets the restart tests stop and start them through scripts/services.sh); otherwise one
private pair is started for the session with scripts/services.sh and stopped at the end.

Every test gets its own database, copied from a template that `build/idem migrate` prepared once,
and its own queue names; the exchange is the contract's default, billing.events.
"""

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import urllib.parse
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "harness"))
import idem_harness  # noqa: E402
# One copy of the servers, database, broker, daemon and metrics helpers (tests/harness); the
# names are re-exported here for the tests, which import them from conftest.
from idem_harness import (EXCHANGE, IDEM, REPO, SERVICES, USD, Broker, Db, Delivery,  # noqa: E402,F401
                          admin_exec, free_port, new_id, payload, read_metrics, metric_sum,
                          run_idem, start_servers, stop_servers, wait_until)
# The TLS instance shared by test_tls_rabbitmq.py and test_tls_postgres.py (one per session).
from tls_helpers import tls_db, tls_queues, tls_servers  # noqa: E402,F401

def _sigterm_as_interrupt(signum, frame):
    # services.sh `with` forwards SIGTERM: tear fixtures down (servers, daemons) like on Ctrl-C.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt("SIGTERM")


signal.signal(signal.SIGTERM, _sigterm_as_interrupt)

# ----------------------------------------------------------------------------- servers


class Servers(idem_harness.Servers):
    def not_ours(self):
        pytest.skip("needs servers started by scripts/services.sh (IDEM_SVC_DIR)")


@pytest.fixture(scope="session")
def servers():
    pg, amqp = os.environ.get("IDEM_PG_URL"), os.environ.get("IDEM_AMQP_URL")
    if pg and amqp:
        yield Servers(pg, amqp, os.environ.get("IDEM_SVC_DIR") or None)
        return
    d = tempfile.mkdtemp(prefix="idem-pytest.")
    try:
        try:
            s = start_servers(d)
        except RuntimeError as e:
            pytest.fail(str(e))
        yield Servers(s.pg_url, s.amqp_url, d)
    finally:
        stop_servers(d)
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def template_db(servers):
    """A database migrated once by `idem migrate --billing` (the bundled handlers' tables too);
    each test's database is a copy of it."""
    if not os.access(IDEM, os.X_OK):
        pytest.fail(f"{IDEM} is missing: run make first")
    name = f"idem_tpl_{os.getpid()}"
    admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}"')
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    r = run_idem("migrate", "--billing", pg_url=servers.db_url(name), amqp_url=servers.amqp_url)
    if r.returncode != 0:
        pytest.fail(f"idem migrate into the template failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    yield name
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db(servers, template_db):
    """A fresh, migrated database for this test."""
    name = "t_" + uuid.uuid4().hex[:16]
    admin_exec(servers, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield Db(servers.db_url(name))
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ----------------------------------------------------------------------------- RabbitMQ


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


@pytest.fixture
def rmq_user(servers):
    """Factory: rmq_user(name_hint, (configure, write, read)) -> an amqp:// URL logging in as a
    new RabbitMQ user with exactly those permissions on vhost "/". Deleted after the test."""
    made = []
    base = urllib.parse.urlsplit(servers.amqp_url)

    def make(hint, perms):
        name = f"it_{hint}_{uuid.uuid4().hex[:8]}"
        password = uuid.uuid4().hex
        servers.rmqctl("add_user", name, password)
        made.append(name)
        servers.rmqctl("set_permissions", "-p", "/", name, *perms)
        return f"amqp://{name}:{password}@{base.hostname}:{base.port}"

    yield make
    for name in made:
        try:
            servers.rmqctl("delete_user", name)
        except AssertionError:
            pass


# ----------------------------------------------------------------------------- daemons


class Daemon(idem_harness.Daemon):
    """A long-running build/idem process with its log in a file, killed if pytest dies, against
    a test's database and the session's broker. Subclasses give it its argv."""

    def __init__(self, name, argv, db, servers, workdir, fault=None, env=None):
        super().__init__(name, argv, workdir, db.url, servers.amqp_url, fault, env)


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
        return read_metrics(self.metrics_port)

    def metric(self, name, **labels):
        """Sum of the samples of name whose labels include the given ones (0 if none)."""
        m = self.try_metrics()
        if m is None:
            raise AssertionError(f"no metrics from consumer {self.name}:\n{self.log()[-3000:]}")
        return metric_sum(m, name, **labels)

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
