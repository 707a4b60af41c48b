"""Helpers for the TLS tests (test_tls_rabbitmq.py, test_tls_postgres.py): one private instance
with TLS listeners for the session (scripts/services.sh --tls: a private CA, amqps on RabbitMQ,
ssl=on and the client-certificate role idem_client on PostgreSQL), a fresh migrated database per
test on it, URLs, a TCP forwarder that makes the servers reachable under a name their
certificate does not list, and reading idem's one-line errors.

conftest.py re-exports the `tls_servers` fixture, so both modules share one instance (~15 s to
start).
"""

import contextlib
import socket
import threading
import urllib.parse
import uuid

import psycopg2
import pytest

from ha_helpers import instance
from idem_harness import Broker, Db, Servers, run_idem


class TlsServers:
    """The session's TLS instance (an ha_helpers.Instance) and what the tests need of it."""

    def __init__(self, inst, template):
        self.inst = inst
        self.template = template
        self.ca = inst.tls("ca")
        self.client_cert = inst.tls("client_cert")
        self.client_key = inst.tls("client_key")
        self.client_user = inst.env["IDEM_TLS_CLIENT_USER"]
        self.pg_port = inst.pg_port()
        self.amqp_port = int(inst.env["IDEM_AMQP_PORT"])
        self.amqps_port = int(inst.env["IDEM_AMQPS_PORT"])
        self.broker = Broker(inst.amqp_url())  # plain AMQP, for setting up and checking

    # PostgreSQL ----------------------------------------------------------------------------
    def pg_url(self, dbname, host="127.0.0.1", user="postgres", **params):
        """postgresql://USER@HOST:PORT/DBNAME?PARAMS (libpq's TLS parameters passed as given)."""
        q = urllib.parse.urlencode(params, safe="/")
        return f"postgresql://{user}@{host}:{self.pg_port}/{dbname}" + (f"?{q}" if q else "")

    def pg_verify_full(self, dbname, **params):
        return self.pg_url(dbname, sslmode="verify-full", sslrootcert=self.ca, **params)

    def admin(self, sql):
        conn = psycopg2.connect(self.pg_url("postgres"), connect_timeout=5)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql)
        finally:
            conn.close()

    # RabbitMQ ------------------------------------------------------------------------------
    def amqp_url(self):
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}"

    def amqps_url(self, host="127.0.0.1", port=None, cacert=True, client_cert=False, **params):
        """amqps://guest:guest@HOST:PORT?cacertfile=CA&... ; cacert=False leaves it out (the
        system CAs), client_cert=True adds certfile and keyfile."""
        q = {}
        if cacert:
            q["cacertfile"] = self.ca
        if client_cert:
            q["certfile"] = self.client_cert
            q["keyfile"] = self.client_key
        q.update(params)
        query = urllib.parse.urlencode(q, safe="/")
        return f"amqps://guest:guest@{host}:{port or self.amqps_port}" + (
            f"?{query}" if query else "")

    def servers(self, amqp_url=None):
        """An idem_harness.Servers for conftest's Consumer (its broker checks go over plain
        AMQP; the daemon gets its own URL through env)."""
        return Servers(self.pg_url("postgres"), amqp_url or self.amqp_url(), None)


def start_tls_instance(*options):
    """A started --tls instance (or OPTIONS) whose database idem is migrated, as a context."""
    return _TlsInstance(options or ("--tls",))


class _TlsInstance:
    def __init__(self, options):
        self.cm = instance(*options)

    def __enter__(self):
        inst = self.cm.__enter__()
        try:
            r = run_idem("migrate", "--billing", pg_url=inst.pg_url, amqp_url=inst.amqp_url())
            if r.returncode != 0:
                raise AssertionError(f"idem migrate on the TLS instance failed:\n{r.stderr}")
        except BaseException:
            self.cm.__exit__(None, None, None)
            raise
        return TlsServers(inst, "idem")

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


@pytest.fixture(scope="session")
def tls_servers():
    """The session's private PostgreSQL + RabbitMQ with TLS listeners (--tls), database idem
    migrated (the template of tls_db)."""
    with start_tls_instance("--tls") as t:
        yield t


@pytest.fixture
def tls_db(tls_servers):
    """A fresh migrated database on the TLS instance; yields its name."""
    name = "t_" + uuid.uuid4().hex[:16]
    tls_servers.admin(f'CREATE DATABASE "{name}" TEMPLATE "{tls_servers.template}"')
    yield name
    with contextlib.suppress(Exception):
        tls_servers.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class TlsQueues:
    """Unique queue names on the TLS broker; the queues and their DLQs are deleted afterwards."""

    def __init__(self, broker):
        self.broker = broker
        self.names = []

    def new(self, tag="q"):
        name = f"it.tls.{tag}.{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        return name

    def cleanup(self):
        for q in self.names:
            self.broker.delete_queue(q)
            self.broker.delete_queue(q + ".dlq")


@pytest.fixture
def tls_queues(tls_servers):
    q = TlsQueues(tls_servers.broker)
    yield q
    q.cleanup()


def tls_database(tls_servers, name):
    """An idem_harness.Db on database name of the TLS instance (plain connections)."""
    return Db(tls_servers.pg_url(name))


# ----------------------------------------------------------------------------- a forwarder


class Forwarder:
    """Listens on LISTEN_HOST (e.g. 127.0.0.2, another loopback address the servers do not listen
    on and their certificate does not name) and forwards each connection to 127.0.0.1:port, so a
    client reaches the server by a name that is not in its certificate."""

    def __init__(self, port, listen_host="127.0.0.2"):
        self.target = ("127.0.0.1", port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((listen_host, 0))
        self.sock.listen(16)
        self.host, self.port = self.sock.getsockname()
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stopping:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.stopping = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- output


def stderr_lines(r):
    return [line for line in r.stderr.splitlines() if line.strip()]


def one_error_line(r, cmd):
    """The single line a failed one-shot command printed on stderr (asserted to be one)."""
    lines = stderr_lines(r)
    assert len(lines) == 1, f"expected one line from idem {cmd}, got:\n{r.stderr}"
    assert lines[0].startswith(f"idem {cmd}: "), lines[0]
    return lines[0]


def connect_lines(log, server="RabbitMQ"):
    """The log lines that report a connection to server (text format)."""
    return [line for line in log.splitlines() if f"connected to {server}" in line]

