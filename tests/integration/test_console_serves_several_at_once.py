"""The console answers several requests at once (contract, `idem console`: "the /metrics
server's bounded-connection rules apply"): a connection that sends its request a byte at a
time, one that never reads its answer, and a request whose handler waits on the database (a
table lock an application holds) leave an ordinary GET its answer within a second, the page's
files and the API alike. And the console tells systemd READY=1 once it listens, STOPPING=1 when
it stops.

Before the console ran its requests on the server's own thread, one after the other: while one
waited on PostgreSQL, every other connection waited too."""

import json
import signal
import socket
import threading
import time

import psycopg2

from conftest import new_id
from console_helpers import Console, consoles  # noqa: F401
from test_daemon_operations import notify_socket  # noqa: F401
from test_dlq_show_and_discard import fill_dlq
from ops_helpers import payload

BOUND_S = 1.0


def timed_get(con, path):
    t0 = time.monotonic()
    status, _, body = con.get(path)
    return status, time.monotonic() - t0, body


def test_stalled_connections_leave_a_get_its_answer(db, servers, broker, queue, consoles):
    # a failed-rows answer of some size (300 kB), for the reader that never reads
    db.execute("SELECT idem.idem_emit('payment.failed', gen_random_uuid(), "
               "gen_random_uuid()::text, %s::jsonb) FROM generate_series(1, 300)",
               json.dumps(payload()))
    db.execute("UPDATE idem.event_outbox SET status = 'failed', attempts = 8, "
               "last_error = repeat('x', 1000)")
    fill_dlq(broker, queue, [(new_id(), "handler_rejected")])
    con = consoles(db, queues=[queue])
    host = f"Host: 127.0.0.1:{con.port}\r\n".encode()

    # 1. a slowloris: its request head a byte at a time, never finished while we measure
    slow = socket.create_connection(("127.0.0.1", con.port), timeout=10)
    stop = threading.Event()

    def dribble():
        for b in b"GET /api/status HTTP/1.1\r\n" + host:
            if stop.is_set():
                return
            try:
                slow.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.05)
    dribbler = threading.Thread(target=dribble)
    dribbler.start()

    # 2. a reader that never reads a large answer (its receive buffer as small as it gets)
    deaf = socket.socket()
    deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    deaf.connect(("127.0.0.1", con.port))
    deaf.sendall(b"GET /api/failed HTTP/1.1\r\n" + host + b"\r\n")

    # 3. a request whose handler waits: /api/status behind an application's lock on the outbox
    locker = psycopg2.connect(db.url)
    locker.cursor().execute("LOCK TABLE idem.event_outbox IN ACCESS EXCLUSIVE MODE")
    waited = {}

    def blocked_status():
        waited["r"] = timed_get(con, "/api/status")
    blocked = threading.Thread(target=blocked_status)
    blocked.start()
    time.sleep(0.5)  # it is in the handler, waiting on the lock
    assert blocked.is_alive(), f"/api/status did not wait on the lock: {waited}"

    try:
        for path in ("/", "/console.js", "/api/config", "/api/history", f"/api/dlq?queue={queue}"):
            status, took, body = timed_get(con, path)
            assert status == 200, (path, status, body[:200])
            assert took < BOUND_S, f"GET {path} took {took:.2f}s beside the stalled connections"
            print(f"GET {path}: {took * 1000:.0f} ms")
        assert blocked.is_alive(), "the lock was let go before the GETs were measured"
    finally:
        locker.rollback()
        locker.close()
        stop.set()
    blocked.join(30)
    status, took, body = waited["r"]
    assert status == 200, body  # answered once the lock went
    dribbler.join(10)
    slow.close()
    deaf.close()


def test_console_tells_systemd_ready_once_listening_and_stopping(db, servers, tmp_path,
                                                                  notify_socket):
    n = notify_socket()
    con = Console(db, servers, str(tmp_path))
    con.env["NOTIFY_SOCKET"] = n.env
    try:
        con.spawn()
        got = n.wait_for("READY=1")
        # READY=1 came after the socket listened: a connection is accepted at once
        socket.create_connection(("127.0.0.1", con.port), timeout=2).close()
        assert any(f"port {con.port}" in d for d in got), got
        con.signal(signal.SIGTERM)
        got = n.wait_for("STOPPING=1", timeout=15)
        assert con.wait_exit(15) == 0
        lines = [ln for d in got for ln in d.split("\n")]
        assert lines.index("READY=1") < lines.index("STOPPING=1")
    finally:
        con.stop()
