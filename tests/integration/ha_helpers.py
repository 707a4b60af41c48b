"""Servers of a test's own: a RabbitMQ cluster, a PostgreSQL synchronous standby, TLS listeners.

Each Instance is one `scripts/services.sh start DIR OPTIONS` (see that script's header for the
options and what env.sh exports) in a temporary directory, always stopped at the end. The
directory is made inside the session's IDEM_SVC_DIR when there is one, so that stopping the
session's servers also reaps an instance that a killed pytest left behind.

    from ha_helpers import instance_fixture
    cluster = instance_fixture("--rmq-nodes", "3")  # at module level

    def test_something(cluster):
        k = cluster.leader("my.queue")
        cluster.rmq_stop(k)
        ...

Starting takes a few seconds (a 3-node cluster 15-20 s): share an instance between the tests of a
module or class, and mark such tests `cluster`.
"""

import atexit
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import urllib.parse

import psycopg2
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICES = os.path.join(REPO, "scripts", "services.sh")

_live = set()  # instances started and not yet stopped, stopped at exit if a teardown never ran


def _services_env():
    # The session's env.sh exports IDEM_PG_PORT and IDEM_AMQP_PORT, which `start` would take as
    # the ports to use: an instance of its own picks free ones.
    return {k: v for k, v in os.environ.items() if k not in ("IDEM_PG_PORT", "IDEM_AMQP_PORT")}


def read_env(path):
    """The variables an env.sh exports, as a dict (shell quoting undone)."""
    out = {}
    with open(path) as f:
        for line in f:
            for word in shlex.split(line, comments=True):
                if word != "export" and "=" in word:
                    k, v = word.split("=", 1)
                    out[k] = v
    return out


class Instance:
    """A private PostgreSQL + RabbitMQ instance started by scripts/services.sh with OPTIONS."""

    def __init__(self, *options, base=None):
        self.options = list(options)
        self.base = base
        self.dir = None
        self.env = {}

    # ------------------------------------------------------------------ life cycle

    def start(self, timeout=300):
        """Starts the instance in a new temporary directory and reads its env.sh; returns self."""
        base = self.base or os.environ.get("IDEM_SVC_DIR")
        if not (base and os.path.isdir(base) and os.access(base, os.W_OK)):
            base = None
        self.dir = tempfile.mkdtemp(prefix="ha-", dir=base)
        _live.add(self)
        r = subprocess.run([SERVICES, "start", self.dir, *self.options], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, env=_services_env())
        if r.returncode != 0:
            self.stop()
            raise AssertionError(f"services.sh start {' '.join(self.options)} failed "
                                 f"({r.returncode}):\n{r.stderr}")
        self.env = read_env(r.stdout.strip())
        return self

    def stop(self):
        """Stops every server of the instance and removes its directory; idempotent."""
        if self.dir is None:
            return
        try:
            subprocess.run([SERVICES, "stop", self.dir], capture_output=True, timeout=180,
                           stdin=subprocess.DEVNULL, env=_services_env())
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
            _live.discard(self)

    def services(self, command, *args, timeout=180, check=True):
        """Runs `services.sh COMMAND DIR ARGS...`; returns its stdout (AssertionError if it fails
        and check is true, else the CompletedProcess)."""
        r = subprocess.run([SERVICES, command, self.dir, *map(str, args)], capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env=_services_env())
        if not check:
            return r
        if r.returncode != 0:
            raise AssertionError(f"services.sh {command} {' '.join(map(str, args))} failed "
                                 f"({r.returncode}): {r.stderr}")
        return r.stdout

    # ------------------------------------------------------------------ RabbitMQ

    @property
    def nodes(self):
        """Number of RabbitMQ nodes."""
        return int(self.env["IDEM_RMQ_NODES"])

    @property
    def amqp_urls(self):
        """The amqp:// URLs of every node, comma-separated (what idem's --amqp accepts)."""
        return self.env["IDEM_AMQP_URLS"]

    def amqp_url(self, node=1):
        """The amqp:// URL of node K."""
        return self.amqp_urls.split(",")[node - 1]

    def node_name(self, node):
        """The Erlang node name of node K (as rabbitmqctl prints it)."""
        return self.env[f"IDEM_RMQ_NODE_{node}"]

    def node_number(self, name):
        """The number K of the node called name."""
        for k in range(1, self.nodes + 1):
            if self.node_name(k) == name:
                return k
        raise KeyError(name)

    def rmq_stop(self, node=None):
        """Stops RabbitMQ node K gracefully (default: every node)."""
        self.services("rmq-stop", *(["--node", node] if node else []))

    def rmq_start(self, node=None):
        """Starts RabbitMQ node K (default: every stopped node) and waits until it is ready."""
        self.services("rmq-start", *(["--node", node] if node else []))

    def rmqctl(self, *args, node=None):
        """rabbitmqctl ARGS against node K (default: the first one running); returns stdout."""
        return self.services("rmqctl", *(["--node", node] if node else []), *args)

    def leader(self, queue):
        """The number K of the node that leads quorum queue QUEUE."""
        return int(self.services("rmq-leader", queue).strip())

    def running_nodes(self, node=None):
        """The numbers of the nodes that node K (default: the first running) sees running."""
        out = self.rmqctl("-q", "cluster_status", "--formatter", "json", node=node)
        return sorted(self.node_number(n) for n in json.loads(out)["running_nodes"])

    # ------------------------------------------------------------------ PostgreSQL

    @property
    def pg_url(self):
        """URL of server 1 (the first primary), database idem."""
        return self.env["IDEM_PG_URL"]

    @property
    def pg_url_ha(self):
        """Multi-host URL of both servers with target_session_attrs=read-write (--pg-standby)."""
        return self.env["IDEM_PG_URL_HA"]

    def pg_port(self, server=1):
        """Port of PostgreSQL server 1 (first primary) or 2 (standby)."""
        return int(self.env["IDEM_PG_PORT" if server == 1 else "IDEM_PG_STANDBY_PORT"])

    def pg_server_url(self, server=1, dbname="idem"):
        """URL of PostgreSQL server 1 or 2 alone."""
        u = urllib.parse.urlsplit(self.pg_url)
        netloc = f"postgres@127.0.0.1:{self.pg_port(server)}"
        return urllib.parse.urlunsplit(u._replace(netloc=netloc, path="/" + dbname))

    @property
    def primary(self):
        """The number of the server that is the primary now (2 after one pg_promote)."""
        try:
            with open(os.path.join(self.dir, "pg", "primary")) as f:
                return int(f.read().strip())
        except FileNotFoundError:
            return 1

    def pg_query(self, sql, *params, server=None, dbname="idem"):
        """Rows of SQL on server S (default: the primary), autocommit."""
        url = self.pg_server_url(server or self.primary, dbname)
        conn = psycopg2.connect(url, connect_timeout=5)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql, params or None)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def replication(self):
        """[(application_name, state, sync_state)] of the primary's pg_stat_replication."""
        return [tuple(r) for r in self.pg_query(
            "SELECT application_name, state, sync_state FROM pg_stat_replication ORDER BY 1")]

    def pg_stop(self, immediate=False, node=None, all=False):
        """Stops the primary (or server N, or every server), with -m immediate if asked."""
        args = ["--immediate"] if immediate else []
        if all:
            args.append("--all")
        elif node:
            args += ["--node", node]
        self.services("pg-stop", *args)

    def pg_start(self, node=None):
        """Starts the primary and its standby (or server N only)."""
        self.services("pg-start", *(["--node", node] if node else []))

    def pg_promote(self):
        """Promotes the standby (the primary must be stopped); it accepts writes on return."""
        self.services("pg-promote")

    def pg_rejoin(self):
        """Rebuilds the server that is not the primary as its synchronous standby."""
        self.services("pg-rejoin")

    # ------------------------------------------------------------------ TLS

    def tls(self, name):
        """A TLS file of the instance: ca, client_cert, client_key, server_cert, wrong_cert..."""
        return self.env["IDEM_TLS_" + name.upper()]


@contextlib.contextmanager
def instance(*options):
    """A started Instance with OPTIONS for the with-block, always stopped after it."""
    inst = Instance(*options)
    try:
        yield inst.start()
    finally:
        inst.stop()


def instance_fixture(*options, scope="module"):
    """A pytest fixture yielding a started Instance with OPTIONS (assign it to a name at module
    level); stopped at the end of its scope ("class": when the class using it is done)."""

    @pytest.fixture(scope=scope)
    def _fixture():
        with instance(*options) as inst:
            yield inst

    return _fixture


@atexit.register
def _stop_leftovers():
    for inst in list(_live):
        with contextlib.suppress(Exception):
            inst.stop()
