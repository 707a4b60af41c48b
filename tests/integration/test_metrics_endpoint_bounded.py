"""/metrics answers only GET and HEAD /metrics, listens on --metrics-addr (127.0.0.1 by default),
and holds a bounded number of connections: 2,000 connections that open and send nothing, against
a consumer limited to 1,024 file descriptors, cannot keep a scrape out for more than a second."""

import resource
import socket
import time
import urllib.request

import pytest

from conftest import free_port


def raw(port, request, timeout=2):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk


def test_methods_and_paths(db, queue, consumers):
    c = consumers("billing", queue, db)
    get = raw(c.metrics_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert get.startswith(b"HTTP/1.1 200 ") and b"idem_consumer_applied_total" in get
    head = raw(c.metrics_port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    assert raw(c.metrics_port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").startswith(
        b"HTTP/1.1 405 ")
    assert raw(c.metrics_port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert raw(c.metrics_port, b"GET /metrics/x HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert raw(c.metrics_port, b"\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    # every status line is one line: code and reason phrase, then the headers
    for req, line in ((b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                       b"HTTP/1.1 405 Method Not Allowed"),
                      (b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 404 Not Found"),
                      (b"\r\n\r\n", b"HTTP/1.1 400 Bad Request")):
        got = raw(c.metrics_port, req)
        status, _, rest = got.partition(b"\r\n")
        assert status == line, got
        assert rest.startswith(b"Content-Type: text/plain\r\n"), got
    # only loopback by default
    assert c.proc.poll() is None


def test_metrics_addr(db, queue, consumers):
    c = consumers("billing", queue, db, args=["--metrics-addr", "127.0.0.2"], metrics=False)
    port = free_port()
    c2 = consumers("billing", queue + "x", db,
                   args=["--metrics-port", str(port), "--metrics-addr", "127.0.0.2"],
                   metrics=False)
    with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=2) as r:
        assert r.status == 200
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert c.proc.poll() is None and c2.proc.poll() is None


def test_slow_connections_cannot_keep_a_scrape_out(db, queue, consumers):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2200:
        pytest.skip(f"needs 2,200 file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2200), hard))
    c = consumers("billing", queue, db, env={"IDEM_TEST_NOFILE": "1024"}, start=False)
    c.argv = ["prlimit", "--nofile=1024:1024", "--", *c.argv]
    c.start()
    slow = []
    try:
        for _ in range(2000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", c.metrics_port))
            slow.append(s)
        time.sleep(0.5)
        for _ in range(3):
            t0 = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics",
                                        timeout=1) as r:
                body = r.read()
            took = time.monotonic() - t0
            assert r.status == 200 and b"idem_build_info" in body
            assert took < 1.0, f"scrape took {took:.2f} s"
        assert c.proc.poll() is None
    finally:
        for s in slow:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
