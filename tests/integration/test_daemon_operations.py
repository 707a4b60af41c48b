"""What an operator runs the daemons with: /healthz (200 `ok` while connected to both servers and
not paused, 503 with one line of reason otherwise), the gauges idem_consumer_up and
idem_outbox_rows{status}, SIGHUP (reload: the log and the password file; the daemon goes on),
systemd readiness over $NOTIFY_SOCKET, and `--log-format json` for every line, fatal ones too."""

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.parse
import uuid

import pytest

from conftest import payload, run_idem, wait_until
from ops_helpers import Relay, add_outbox, emit, parse_prometheus, scrape, value
from ops_helpers import relays  # noqa: F401  (fixture)

UNREACHABLE_PG = "postgresql://postgres@127.0.0.1:1/none"
UNREACHABLE_AMQP = "amqp://guest:guest@127.0.0.1:1"


def healthz(port):
    """(status, body) of GET /healthz; (None, error) when nothing answers."""
    try:
        status, _, text = scrape(port, "/healthz")
    except OSError as e:
        return None, str(e)
    return status, text


def wait_health(port, status, timeout=30, daemons=()):
    def ok():
        for d in daemons:
            assert d.running(), f"{d.name} exited:\n{d.log()[-3000:]}"
        return healthz(port)[0] == status
    wait_until(ok, timeout, 0.1, lambda: f"/healthz {status} (now {healthz(port)})")
    return healthz(port)[1]


def head(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    try:
        conn.request("HEAD", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def gauges(port):
    status, _, text = scrape(port)
    assert status == 200
    return parse_prometheus(text)


# ----------------------------------------------------------------------------- /healthz


def test_healthz_follows_postgres(servers, db, queue, consumers, relays):
    c = consumers("billing", queue, db)
    r = relays()
    for d in (c, r):
        assert wait_health(d.metrics_port, 200) == "ok\n"
        assert head(d.metrics_port, "/healthz") == (200, b"")
    m = gauges(c.metrics_port)
    assert m["types"]["idem_consumer_up"] == "gauge"
    assert value(m, "idem_consumer_up") == 1

    servers.pg_stop()
    try:
        for d in (c, r):
            text = wait_health(d.metrics_port, 503, daemons=(c, r))
            print(f"{d.name} /healthz with PostgreSQL stopped: {text!r}")
            assert text.endswith("\n") and len(text.splitlines()) == 1, text
            assert text.startswith("postgres: "), text
            assert head(d.metrics_port, "/healthz")[0] == 503
        assert value(gauges(c.metrics_port), "idem_consumer_up") == 0
    finally:
        servers.pg_start()

    for d in (c, r):
        assert wait_health(d.metrics_port, 200, timeout=60, daemons=(c, r)) == "ok\n"
    assert value(gauges(c.metrics_port), "idem_consumer_up") == 1
    # and they work again
    c.broker.publish_event("payment.failed", payload())
    c.wait_handled(1, timeout=30)
    assert c.stop() == 0 and r.stop() == 0


def test_healthz_while_paused(db, queue, consumers, broker):
    """A pause (here 42P01: the handler's table is gone) is unhealthy with its SQLSTATE, and
    healthy again once the consumer resumed."""
    c = consumers("billing", queue, db)
    wait_health(c.metrics_port, 200)
    schema = db.scalar("SELECT n.nspname FROM pg_class t JOIN pg_namespace n ON n.oid = "
                       "t.relnamespace WHERE t.relname = 'dunning' AND t.relkind = 'r'")
    db.execute(f'ALTER TABLE "{schema}".dunning RENAME TO dunning_away')
    try:
        broker.publish_event("payment.failed", payload())
        assert wait_health(c.metrics_port, 503, daemons=(c,)) == "paused: 42P01\n"
        assert value(gauges(c.metrics_port), "idem_consumer_up") == 0
    finally:
        db.execute(f'ALTER TABLE "{schema}".dunning_away RENAME TO dunning')
    c.wait_handled(1, timeout=60)
    assert wait_health(c.metrics_port, 200, daemons=(c,)) == "ok\n"
    assert value(gauges(c.metrics_port), "idem_consumer_up") == 1
    assert c.stop() == 0


def test_outbox_rows_gauge(db, relays):
    """idem_outbox_rows{status}: the relay's count of pending and failed rows, fresh within a few
    seconds; the consumer's gauges are not the relay's."""
    failed = add_outbox(db, 3, status="failed", attempts=8, last_error="x")
    waiting = add_outbox(db, 4, status="pending", attempts=1)
    # pending but not due for an hour: the relay leaves them where they are
    db.execute("UPDATE idem.event_outbox SET next_attempt_at = now() + interval '1 hour' "
               "WHERE event_id = ANY(%s::uuid[])", waiting)
    r = relays()
    m = gauges(r.metrics_port)
    assert m["types"]["idem_outbox_rows"] == "gauge"
    assert "idem_consumer_up" not in m["types"]

    def rows(status):
        return value(gauges(r.metrics_port), "idem_outbox_rows", status=status)

    wait_until(lambda: rows("pending") == 4 and rows("failed") == 3, 10, 0.2,
               lambda: f"pending 4, failed 3 (now {rows('pending')}, {rows('failed')})")
    add_outbox(db, 2, status="failed", attempts=8, last_error="x")
    t0 = time.monotonic()
    wait_until(lambda: rows("failed") == 5, 10, 0.1, lambda: f"failed 5 (now {rows('failed')})")
    print(f"idem_outbox_rows followed an insert within {time.monotonic() - t0:.2f} s")
    assert rows("pending") == 4
    assert len(failed) == 3
    assert r.stop() == 0


# ----------------------------------------------------------------------------- SIGHUP


def test_sighup_reloads_and_keeps_running(db, servers, queue, consumers, broker, relays):
    c = consumers("billing", queue, db)
    r = relays()
    for d in (c, r):
        d.signal(signal.SIGHUP)
        wait_until(lambda: "reloaded" in d.log() or not d.running(), 10, 0.1,
                   f"{d.name} logged reloaded")
        assert d.running(), f"{d.name} exited with {d.returncode} on SIGHUP:\n{d.log()[-2000:]}"
        assert [ln for ln in d.log().splitlines() if "reloaded" in ln and " info " in ln], d.log()
    # both go on working
    body = payload()
    emit(db, "payment.failed", body)
    wait_until(lambda: value(r.metrics(), "idem_relay_published_total") == 1, 15, 0.1,
               "the relay published the event")
    c.wait_handled(1)
    assert db.dunning_step(body["subscription_id"]) == 1
    assert c.stop() == 0 and r.stop() == 0


def rmq_user_connections(servers, user):
    out = servers.rmqctl("-q", "list_connections", "user", "pid", "--no-table-headers")
    return [line.split()[1] for line in out.splitlines()
            if len(line.split()) == 2 and line.split()[0] == user]


@pytest.mark.slow  # a password change and a forced reconnect: 8-20 s
def test_sighup_rereads_the_password_file(servers, db, queue, consumers, broker, tmp_path):
    """The password changes on RabbitMQ and in the file; after SIGHUP the next connection uses
    the new one (the old connection is closed by the broker to force it)."""
    user = f"it_hup_{uuid.uuid4().hex[:8]}"
    old, new = f"old-{uuid.uuid4().hex}", f"new-{uuid.uuid4().hex}"
    servers.rmqctl("add_user", user, old)
    servers.rmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
    try:
        pw = tmp_path / "amqp-password"
        pw.write_text(old + "\n")
        pw.chmod(0o600)
        u = urllib.parse.urlsplit(servers.amqp_url)
        url = f"amqp://{user}:not-the-password@{u.hostname}:{u.port}/"
        c = consumers("billing", queue, db,
                      env={"IDEM_AMQP_URL": url, "IDEM_AMQP_PASSWORD_FILE": str(pw)})
        broker.publish_event("payment.failed", payload())
        c.wait_handled(1)

        servers.rmqctl("change_password", user, new)
        tmp = tmp_path / "amqp-password.new"
        tmp.write_text(new + "\n")
        tmp.chmod(0o600)
        os.replace(tmp, pw)
        c.signal(signal.SIGHUP)
        wait_until(lambda: "reloaded" in c.log() or not c.running(), 10, 0.1, "reloaded")
        assert c.running(), c.log()[-2000:]

        pids = rmq_user_connections(servers, user)
        assert pids, "the consumer has no connection as its user"
        for pid in pids:
            with contextlib.suppress(AssertionError):
                servers.rmqctl("close_connection", pid, "password rotated")
        wait_until(lambda: c.metric("idem_reconnects_total", server="rabbitmq") >= 1, 30, 0.2,
                   "the consumer reconnected to RabbitMQ")
        c.wait_ready(30)
        broker.publish_event("payment.failed", payload())
        c.wait_handled(2, timeout=30)
        log = c.log()
        assert old not in log and new not in log, "a password in the log"
        assert "ACCESS_REFUSED" not in log and "refused" not in log.lower(), log[-3000:]
        assert c.stop() == 0
    finally:
        with contextlib.suppress(AssertionError):
            servers.rmqctl("delete_user", user)


# ----------------------------------------------------------------------------- sd_notify


class NotifySocket:
    """A unix datagram socket for $NOTIFY_SOCKET: a path, or an abstract name (`@...`)."""

    def __init__(self, abstract):
        self.dir = tempfile.mkdtemp(prefix="idem-n.")  # a short path: sun_path is 108 bytes
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"idem-notify-{uuid.uuid4().hex[:12]}"
            self.sock.bind("\0" + name)
            self.env = "@" + name
        else:
            path = os.path.join(self.dir, "notify")
            self.sock.bind(path)
            self.env = path
        self.got = []

    def wait_for(self, line, timeout=30):
        """Receives datagrams until one has the line `line`; returns every datagram so far."""
        deadline = time.monotonic() + timeout
        while not any(line in d.split("\n") for d in self.got):
            left = deadline - time.monotonic()
            assert left > 0, f"no {line} within {timeout}s; got {self.got}"
            self.sock.settimeout(left)
            try:
                self.got.append(self.sock.recv(4096).decode())
            except socket.timeout:
                pass
        return self.got

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify_socket():
    made = []

    def make(abstract=False):
        n = NotifySocket(abstract)
        made.append(n)
        return n
    yield make
    for n in made:
        n.close()


def test_consumer_tells_systemd_ready_and_stopping(db, queue, consumers, broker, notify_socket):
    n = notify_socket()
    c = consumers("billing", queue, db, env={"NOTIFY_SOCKET": n.env}, start=False)
    c.spawn()
    got = n.wait_for("READY=1")
    info = broker.queue_info(queue)
    assert info is not None and info[1] >= 1, f"READY=1 before consuming: {info}"
    print(f"consumer datagrams up to READY=1: {got}")
    c.wait_ready()
    c.signal(signal.SIGTERM)
    got = n.wait_for("STOPPING=1", timeout=15)
    assert c.wait_exit(15) == 0
    lines = [ln for d in got for ln in d.split("\n")]
    assert lines.index("READY=1") < lines.index("STOPPING=1")
    assert "NOTIFY_SOCKET" not in c.log()


def test_relay_tells_systemd_ready_on_an_abstract_socket(db, servers, tmp_path, notify_socket):
    n = notify_socket(abstract=True)
    r = Relay(db, servers, str(tmp_path))
    r.env["NOTIFY_SOCKET"] = n.env
    try:
        r.spawn()
        got = n.wait_for("READY=1")
        print(f"relay datagrams up to READY=1: {got}")
        # serving: its first claim ran, so a new row goes out (returned: no queue is bound)
        emit(db, "payment.failed", payload())

        def tried():
            m = r.metrics()
            return (value(m, "idem_relay_published_total")
                    + value(m, "idem_relay_publish_failures_total")) >= 1
        wait_until(lambda: r._up() and tried(), 15, 0.1, "the relay published")
        r.signal(signal.SIGHUP)
        got = n.wait_for("RELOADING=1", timeout=10)
        r.signal(signal.SIGTERM)
        got = n.wait_for("STOPPING=1", timeout=15)
        assert r.wait_exit(15) == 0
        assert any(d.startswith("STATUS=") or "\nSTATUS=" in d for d in got), got
    finally:
        r.kill()


# ----------------------------------------------------------------------------- JSON lines


def json_lines(stderr):
    lines = stderr.splitlines()
    assert lines, "nothing on stderr"
    out = []
    for ln in lines:
        try:
            obj = json.loads(ln)
        except ValueError:
            raise AssertionError(f"not a JSON line: {ln!r}\n(all: {stderr!r})")
        assert isinstance(obj, dict) and {"ts", "level", "msg"} <= set(obj), ln
        out.append(obj)
    return out


def test_json_log_format_covers_fatal_and_usage_lines(db, servers, tmp_path):
    loose = tmp_path / "pw-loose"
    loose.write_text("secret-in-a-loose-file\n")
    loose.chmod(0o644)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    cases = [
        # cannot start: the password file is readable by others
        (["consume", "--consumer", "c", "--queue", "q", "--log-format", "json"],
         {"IDEM_AMQP_PASSWORD_FILE": str(loose)}, 1, "password file"),
        (["--log-format", "json", "relay"], {"IDEM_AMQP_PASSWORD_FILE": str(loose)}, 1,
         "password file"),
        # cannot start: the metrics port is taken
        (["relay", "--log-format=json", "--metrics-port", port], None, 1, "metrics"),
        # usage errors once the format is known
        (["consume", "--log-format", "json", "--queue", "q"], None, 2, "--consumer"),
        (["consume", "--log-format", "json", "--bogus"], None, 2, "--bogus"),
        (["--log-format", "json", "relay", "--batch", "zero"], None, 2, "--batch"),
    ]
    try:
        for args, env, code, what in cases:
            r = run_idem(*args, pg_url=UNREACHABLE_PG, amqp_url=UNREACHABLE_AMQP, env=env,
                         timeout=20)
            assert r.returncode == code, (args, r.returncode, r.stderr)
            objs = json_lines(r.stderr)
            print(f"idem {' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
            assert objs[-1]["level"] == "error", objs
            assert what in objs[-1]["msg"], objs
            assert "secret-in-a-loose-file" not in r.stderr
    finally:
        busy.close()
    # a daemon that runs and is stopped: every line JSON too
    r = run_idem("relay", "--once", "--log-format", "json", "--log-level", "debug",
                 pg_url=db.url, amqp_url=servers.amqp_url, timeout=30)
    assert r.returncode == 0, r.stderr
    json_lines(r.stderr)
