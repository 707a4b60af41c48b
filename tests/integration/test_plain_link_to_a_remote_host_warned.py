"""A link without TLS to a host that is not loopback is logged as a warning, for PostgreSQL and
RabbitMQ, by daemons and one-shot commands alike: with libpq's default sslmode=prefer, a server
(or anyone on the path) that answers the TLS request with 'no' gets the password and every
statement in clear, and nothing else would say so. The servers listen on loopback only; the
links go through a TCP forwarder on this host's non-loopback address. A link to loopback is not
warned."""

import json
import socket
import subprocess
import threading
import time
import urllib.parse

import pytest

from conftest import IDEM, run_idem

PG_WARN = "connected to PostgreSQL without TLS (tls=off) on a host that is not loopback"
RMQ_WARN = "connected to RabbitMQ without TLS (tls=off) on a host that is not loopback"


def non_loopback_ipv4():
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1].split("/")[0]
    pytest.fail("this host has no non-loopback IPv4 address to forward through")


class Forwarder:
    """Accepts on (addr, any port) and copies bytes both ways to 127.0.0.1:target."""

    def __init__(self, addr, target):
        self.target = target
        self.ls = socket.socket()
        self.ls.bind((addr, 0))
        self.ls.listen(32)
        self.port = self.ls.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                c, _ = self.ls.accept()
                u = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    @staticmethod
    def pump(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.ls.close()


@pytest.fixture
def remote(db, servers):
    """(pg_url, amqp_url) that reach the test's servers through this host's non-loopback
    address."""
    addr = non_loopback_ipv4()
    pg, amqp = urllib.parse.urlsplit(db.url), urllib.parse.urlsplit(servers.amqp_url)
    fp, fa = Forwarder(addr, pg.port), Forwarder(addr, amqp.port)
    netloc = lambda u, port: f"{u.username}{':' + u.password if u.password else ''}@{addr}:{port}"
    yield (urllib.parse.urlunsplit(pg._replace(netloc=netloc(pg, fp.port))),
           urllib.parse.urlunsplit(amqp._replace(netloc=netloc(amqp, fa.port))))
    fp.close()
    fa.close()


def with_sslmode(url, mode):
    return url + ("&" if "?" in url else "?") + f"sslmode={mode}"


def test_one_shot_commands_warn(remote):
    pg, amqp = remote
    for mode in ("prefer", "disable", "allow"):
        r = run_idem("status", "--json", pg_url=with_sslmode(pg, mode))
        assert r.returncode == 0, (mode, r.stderr)
        json.loads(r.stdout)  # the result is untouched
        warns = [line for line in r.stderr.splitlines() if PG_WARN in line]
        assert len(warns) == 1 and "tls=off" in warns[0], (mode, r.stderr)
    r = run_idem("relay", "--once", pg_url=pg, amqp_url=amqp)
    assert r.returncode == 0, r.stderr
    assert PG_WARN in r.stderr and RMQ_WARN in r.stderr, r.stderr


def test_daemon_warns_in_text_and_json(remote, tmp_path):
    pg, amqp = remote
    for fmt in ("text", "json"):
        p = subprocess.Popen([IDEM, "relay", "--poll-interval", "1s", "--log-format", fmt],
                             env={"IDEM_PG_URL": pg, "IDEM_AMQP_URL": amqp, "PATH": "/usr/bin"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             cwd=str(tmp_path))
        try:
            time.sleep(2)
        finally:
            p.terminate()
            err = p.communicate(timeout=15)[1]
        assert p.returncode == 0, err
        lines = [line for line in err.splitlines() if line.strip()]
        for want in (PG_WARN, RMQ_WARN):
            warns = [line for line in lines if want in line]
            assert warns, (fmt, want, err)
            if fmt == "json":
                rec = json.loads(warns[0])
                assert rec["level"] == "warn" and rec["tls"] == "off", rec


def test_loopback_is_not_warned(db, servers):
    r = run_idem("relay", "--once", pg_url=with_sslmode(db.url, "prefer"),
                 amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stderr
    assert "not loopback" not in r.stderr, r.stderr
