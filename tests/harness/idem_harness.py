"""Shared harness for programs that drive idem against real servers: the integration tests
(tests/integration/conftest.py), the chaos audit (scripts/chaos.py), the demo (scripts/demo.py)
and the benchmark (bench/bench.py).

One copy of: polling and ports, the private servers of scripts/services.sh (start, stop, restart,
rabbitmqctl), PostgreSQL access, RabbitMQ access (publish, passive declare, purge, read a queue),
a long-running build/idem process with its log in a file (and its CPU time and peak memory), a
Prometheus scrape with counters kept across a daemon's restarts, and SVG charts through gnuplot.

No pytest here: a failed expectation raises AssertionError, a missing server RuntimeError.
Needs Debian's interpreter (/usr/bin/python3: pika, psycopg2).
"""

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid

import pika
import psycopg2

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IDEM = os.environ.get("IDEM_BIN", os.path.join(REPO, "build", "idem"))
SERVICES = os.path.join(REPO, "scripts", "services.sh")
PGBIN = "/usr/lib/postgresql/15/bin"
EXCHANGE = "billing.events"
USD = "USD"

# ----------------------------------------------------------------------------- generic helpers


def wait_until(pred, timeout=15.0, interval=0.05, what="condition", daemons=()):
    """Polls pred() until it returns a truthy value, which is returned; fails after timeout, or
    as soon as one of daemons (Daemon objects that must stay up meanwhile) has exited."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = pred()
        if last:
            return last
        for d in daemons:
            if d.proc is not None and d.proc.poll() is not None:
                what = what() if callable(what) else what
                raise AssertionError(f"{d.name} exited with status {d.proc.returncode} while "
                                     f"waiting for {what}; end of {d.logpath}:\n"
                                     f"{d.log()[-2000:]}")
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
    """A payload of the bundled billing handlers (fresh ids unless given)."""
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


def die_with_parent():
    """preexec_fn: the child gets SIGKILL when the thread that started it exits, so that no
    daemon outlives its driver, whatever kills the driver. Start daemons from the main thread."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ----------------------------------------------------------------------------- servers


class Servers:
    """A PostgreSQL + RabbitMQ pair; svc_dir is the scripts/services.sh directory that can stop,
    start and query them (None when they are not ours to control)."""

    def __init__(self, pg_url, amqp_url, svc_dir):
        self.pg_url = pg_url
        self.amqp_url = amqp_url
        self.svc_dir = svc_dir

    def not_ours(self):
        raise RuntimeError("needs servers started by scripts/services.sh (IDEM_SVC_DIR)")

    def services(self, *args, timeout=120):
        """scripts/services.sh CMD SVC_DIR ARGS...; returns its stdout."""
        if not self.svc_dir:
            self.not_ours()
        r = subprocess.run([SERVICES, *args[:1], self.svc_dir, *args[1:]], capture_output=True,
                           text=True, timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"services.sh {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r.stdout

    def pg_stop(self):
        self.services("pg-stop")

    def pg_start(self):
        self.services("pg-start")

    def pg_stop_immediate(self, timeout=60):
        """pg_ctl -m immediate stop (a crash: no checkpoint, clients cut off), as user postgres."""
        if not self.svc_dir:
            self.not_ours()
        data = os.path.join(self.svc_dir, "pg", "data")
        r = subprocess.run(["runuser", "-u", "postgres", "--", f"{PGBIN}/pg_ctl", "-D", data,
                            "-m", "immediate", "-w", "-t", "30", "stop"],
                           cwd=os.path.join(self.svc_dir, "pg"), capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise AssertionError(f"pg_ctl -m immediate stop failed ({r.returncode}): {r.stderr}")

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

    def export(self, env=None):
        """Sets IDEM_PG_URL, IDEM_AMQP_URL (and IDEM_SVC_DIR) in env (default os.environ), for
        the tools that read them."""
        env = os.environ if env is None else env
        env["IDEM_PG_URL"] = self.pg_url
        env["IDEM_AMQP_URL"] = self.amqp_url
        if self.svc_dir:
            env["IDEM_SVC_DIR"] = self.svc_dir
        return env


def start_servers(directory, durable=False, timeout=180, stderr=None):
    """scripts/services.sh start DIR [--durable]; returns Servers, or raises RuntimeError. The
    script's own messages go to stderr (a file object; default: this process's stderr)."""
    args = [SERVICES, "start", directory] + (["--durable"] if durable else [])
    r = subprocess.run(args, stdout=subprocess.PIPE, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, stderr=stderr)
    if r.returncode != 0:
        where = "above" if stderr is None else getattr(stderr, "name", "its log")
        raise RuntimeError(f"scripts/services.sh start failed ({r.returncode}); see {where}")
    env = {}
    with open(r.stdout.strip()) as f:
        for word in f.read().split():
            if "=" in word:
                k, v = word.split("=", 1)
                env[k] = v
    return Servers(env["IDEM_PG_URL"], env["IDEM_AMQP_URL"], directory)


def servers_from_env():
    """The servers named by IDEM_PG_URL and IDEM_AMQP_URL (IDEM_SVC_DIR, when set, lets them be
    restarted), or None when either URL is missing."""
    pg, amqp = os.environ.get("IDEM_PG_URL"), os.environ.get("IDEM_AMQP_URL")
    if not pg or not amqp:
        return None
    return Servers(pg, amqp, os.environ.get("IDEM_SVC_DIR") or None)


def stop_servers(directory, timeout=120, quiet=False):
    """scripts/services.sh stop DIR (idempotent; leaves no process behind)."""
    subprocess.run([SERVICES, "stop", directory], timeout=timeout, stdin=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL if quiet else None)


# ----------------------------------------------------------------------------- PostgreSQL


def admin_exec(servers, sql):
    """Runs sql in autocommit on the postgres database (CREATE/DROP DATABASE)."""
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


class Db:
    """One database. By default every call opens its own short connection; with keep=True the
    calls share one connection, opened on first use and opened again after it broke (a
    program's sampling loop, or a benchmark's session settings). options / application_name /
    connect_timeout are passed to psycopg2.connect."""

    def __init__(self, url, keep=False, options=None, application_name=None, connect_timeout=5):
        self.url = url
        self.keep = keep
        self.kw = {"connect_timeout": connect_timeout}
        if options:
            self.kw["options"] = options
        if application_name:
            self.kw["application_name"] = application_name
        self.conn = None

    def _kept(self):
        if self.conn is None or self.conn.closed:
            self.conn = psycopg2.connect(self.url, **self.kw)
            self.conn.autocommit = True
        return self.conn

    @contextlib.contextmanager
    def connect(self, autocommit=True):
        if self.keep:
            conn = self._kept()
            try:
                conn.autocommit = autocommit
                yield conn
            except psycopg2.OperationalError:
                self.close()  # broken: the next call connects again
                raise
            finally:
                if self.conn is not None and not self.conn.closed and not autocommit:
                    with contextlib.suppress(psycopg2.Error):
                        self.conn.rollback()  # a no-op after the caller's commit
                        self.conn.autocommit = True
            return
        conn = psycopg2.connect(self.url, **self.kw)
        conn.autocommit = autocommit
        try:
            yield conn
        finally:
            conn.close()

    def close(self):
        """Closes the kept connection (keep=True); the next call opens a new one."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None

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
        return self.scalar("SELECT step FROM billing.dunning WHERE subscription_id = %s", subscription_id)

    def ledger(self, consumer=None):
        """[(consumer, event_id)] of consumed_events, ordered."""
        if consumer is None:
            rows = self.query("SELECT consumer, event_id::text FROM idem.consumed_events ORDER BY 1, 2")
        else:
            rows = self.query("SELECT consumer, event_id::text FROM idem.consumed_events WHERE consumer = %s"
                              " ORDER BY 1, 2", consumer)
        return [tuple(r) for r in rows]

    def count(self, table, where="true", *params):
        return self.scalar(f"SELECT count(*) FROM {table} WHERE {where}", *params)


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
    """One RabbitMQ; every call opens its own short connection."""

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
        broker's confirm; an unroutable message raises (mandatory)."""
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

    def queue_infos(self, queues):
        """{queue: (message_count, consumer_count) or None if it does not exist}, by passive
        declares on one connection. message_count counts ready messages only."""
        out = {}
        with self.channel() as ch:
            for q in queues:
                try:
                    ok = ch.queue_declare(queue=q, passive=True).method
                    out[q] = (ok.message_count, ok.consumer_count)
                except pika.exceptions.ChannelClosedByBroker as e:
                    if e.reply_code != 404:
                        raise
                    out[q] = None
                    ch = ch.connection.channel()
        return out

    def queue_info(self, queue):
        """(message_count, consumer_count), or None if the queue does not exist."""
        return self.queue_infos([queue])[queue]

    def depth(self, queue):
        """Ready messages (unacked ones are not counted: stop the consumer first)."""
        info = self.queue_info(queue)
        return None if info is None else info[0]

    def get_all(self, queue, idle=0.3, timeout=60):
        """Takes every ready message off queue (acking them): at least as many as were ready when
        called (up to timeout), then whatever comes within idle seconds. A consumer, not
        basic.get: a queue with single active consumer refuses basic.get. Each message is acked
        as it is taken, so what the broker had sent but was not taken yet when it stops goes back
        to the queue (with auto_ack it would be lost); a small prefetch bounds the memory of
        large bodies."""
        info = self.queue_info(queue)
        want = info[0] if info else 0
        out = []
        deadline = time.monotonic() + timeout
        with self.channel() as ch:
            ch.basic_qos(prefetch_count=8)
            for method, props, body in ch.consume(queue, auto_ack=False, inactivity_timeout=idle):
                if method is None:
                    if len(out) >= want or time.monotonic() >= deadline:
                        break
                    continue
                out.append(Delivery(method, props, body))
                ch.basic_ack(method.delivery_tag)
            ch.cancel()  # requeues what was sent and not taken
        return out

    def delete_queue(self, queue):
        with contextlib.suppress(Exception), self.channel() as ch:
            ch.queue_delete(queue=queue)

    def purge_queue(self, queue):
        """Removes the ready messages of queue; returns how many, or None if there is no such
        queue."""
        with self.channel() as ch:
            try:
                return ch.queue_purge(queue=queue).method.message_count
            except pika.exceptions.ChannelClosedByBroker as e:
                if e.reply_code != 404:
                    raise
                return None


def wait_for_consumers(broker, queues, count=1, daemons=(), timeout=30):
    """Waits until every queue in queues exists and has at least count consumers (0: exists),
    e.g. until `idem consume` processes declared their topology and consume, so that what is
    published next is routed. Fails early if one of daemons exits meanwhile."""
    queues = list(queues)

    def ready():
        infos = broker.queue_infos(queues)
        return all(i is not None and i[1] >= count for i in infos.values())

    return wait_until(ready, timeout, 0.1,
                      f"{count} consumer(s) on each of {', '.join(queues)}", daemons)


# ----------------------------------------------------------------------------- daemons


class Daemon:
    """A long-running build/idem process with its output appended to a log file, killed if its
    driver dies. start/stop/kill/log/wait_exit are shared by every kind of daemon; spawn may be
    called again after the process exited (a restart, same log file)."""

    def __init__(self, name, argv, workdir, pg_url, amqp_url, fault=None, env=None, logpath=None,
                 new_session=False):
        self.name = name
        self.argv = argv
        self.env = dict(os.environ, IDEM_PG_URL=pg_url, IDEM_AMQP_URL=amqp_url)
        self.env.pop("IDEM_FAULT", None)
        if fault:
            self.env["IDEM_FAULT"] = fault
        if env:
            self.env.update(env)
        self.logpath = logpath or os.path.join(workdir, f"{name}-{uuid.uuid4().hex[:6]}.log")
        self.new_session = new_session
        self.proc = None
        self.logfile = None
        self.paused = False

    @property
    def fault(self):
        return self.env.get("IDEM_FAULT")

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self):
        """The exit status of the last process (negative: the signal that ended it), None
        while it runs or before the first spawn."""
        return self.proc.poll() if self.proc is not None else None

    def set_fault(self, fault):
        """IDEM_FAULT of the next spawn (None: none)."""
        self.env.pop("IDEM_FAULT", None)
        if fault:
            self.env["IDEM_FAULT"] = fault

    def spawn(self, banner=None):
        """Starts the process; banner, when given, is written to the log first (one line)."""
        assert not self.running(), "already running"
        self.close()
        self.logfile = open(self.logpath, "ab")
        self.paused = False
        if banner:
            self.logfile.write(banner.rstrip("\n").encode() + b"\n")
            self.logfile.flush()
        # new_session: a Ctrl-C on the terminal reaches the driver only, which stops the rest.
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self.logfile, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent,
                                     start_new_session=self.new_session)
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

    def pause(self):
        """SIGSTOP (resume() or stop() continues it)."""
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def wait_exit(self, timeout=15):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s:\n"
                                 f"{self.log()[-3000:]}")

    def stop(self, timeout=15, kill_after=False):
        """SIGTERM and wait; returns the exit status. After timeout: AssertionError, or with
        kill_after, SIGKILL (the status is then -9)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.paused:
                self.resume()
        try:
            return self.wait_exit(timeout)
        except AssertionError:
            if not kill_after:
                raise
            self.proc.kill()
            return self.proc.wait(10)
        finally:
            self.close()

    def cpu_seconds(self):
        """User + system CPU time of the running process so far (None once it exited)."""
        return proc_cpu_seconds(self.pid) if self.running() else None

    def peak_rss_kib(self):
        """Peak resident memory (VmHWM) of the running process (None once it exited)."""
        return proc_peak_rss_kib(self.pid) if self.running() else None

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.close()

    def close(self):
        if self.logfile is not None:
            with contextlib.suppress(Exception):
                self.logfile.close()
            self.logfile = None


def proc_cpu_seconds(pid):
    """utime + stime of a process, from /proc/PID/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
    except OSError:
        return None
    rest = st[st.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


def proc_peak_rss_kib(pid):
    """VmHWM of a process, from /proc/PID/status; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def declare_consumer_topology(servers, queue, workdir, consumer="harness", args=(),
                              timeout=30):
    """Has `idem consume --queue QUEUE ARGS...` declare its own topology (the exchange, QUEUE with
    its dead-letter exchange and queue, the bindings), waits until it consumes, and stops it:
    the queue can then be filled before the consumer being measured starts, and it is exactly
    what idem declares."""
    d = Daemon(f"declare-{queue}", [IDEM, "consume", "--consumer", consumer, "--queue", queue,
                                    *args], workdir, servers.pg_url, servers.amqp_url)
    d.spawn()
    try:
        wait_for_consumers(Broker(servers.amqp_url), [queue], 1, [d], timeout)
    finally:
        rc = d.stop(kill_after=True)
    if rc != 0:
        raise AssertionError(f"idem consume (declaring {queue}) exited {rc} on SIGTERM:\n"
                             f"{d.log()[-2000:]}")


# ----------------------------------------------------------------------------- metrics


def read_metrics(port, timeout=2):
    """{'name{labels}': value} of http://127.0.0.1:port/metrics, or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
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


def metric_sum(metrics, name, **labels):
    """Sum of the samples of name whose labels include the given ones (0 if none)."""
    total = 0.0
    for key, v in metrics.items():
        base, _, lab = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', lab))
        if all(have.get(k) == str(v2) for k, v2 in labels.items()):
            total += v
    return total


class Counters:
    """Counters of one daemon slot summed over its instances. A restarted process starts its
    counters at 0: the last scrape of each instance is kept and added to the totals when the
    instance goes away (retire()). names: {key: metric name}; a key's value is the sum of
    that metric's samples (all labels)."""

    def __init__(self, names):
        self.names = dict(names)
        self.base = {k: 0.0 for k in self.names}
        self.last = {}

    def scrape(self, port, timeout=2):
        """Reads the running instance's counters; False if it did not answer."""
        m = read_metrics(port, timeout)
        if m is None:
            return False
        self.last = {k: metric_sum(m, name) for k, name in self.names.items()}
        return True

    def retire(self):
        """The instance is gone: its last scrape joins the totals."""
        for k, v in self.last.items():
            self.base[k] += v
        self.last = {}

    def total(self, key):
        return self.base[key] + self.last.get(key, 0.0)


# ----------------------------------------------------------------------------- charts


GNUPLOT = "/usr/bin/gnuplot"


def have_gnuplot():
    return os.access(GNUPLOT, os.X_OK)


def gnuplot(script, cwd=None, timeout=60):
    """Runs a gnuplot script (text; it sets its own terminal and output). Raises RuntimeError
    with gnuplot's message if gnuplot is missing (Debian: gnuplot-nox) or fails."""
    if not have_gnuplot():
        raise RuntimeError(f"{GNUPLOT} not found (Debian package gnuplot-nox; make deps)")
    r = subprocess.run([GNUPLOT], input=script, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"gnuplot failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    return r.stderr  # warnings, if any


def gp_str(text):
    """text as a gnuplot string literal (single quotes; no escapes are interpreted)."""
    return "'" + str(text).replace("'", "''") + "'"
