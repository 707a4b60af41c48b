"""Helpers shared by the consumer fault-path tests: small C programs built against the library,
failure injection with triggers, and reading a consumer's log and memory."""

import contextlib
import os
import re
import select
import shlex
import socket
import struct
import subprocess
import threading
import time
import urllib.parse

from conftest import IDEM

PROGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs")
BUILD = os.path.dirname(os.path.abspath(IDEM))  # build/ (or the build dir of IDEM_BIN)


def build_pkg_config(*args):
    """`pkg-config ARGS idem` against the uninstalled idem.pc of the build under test
    (BUILD/idem-uninstalled.pc, which `make` writes); returns its output, split as a shell would."""
    pc = os.path.join(BUILD, "idem-uninstalled.pc")
    assert os.path.exists(pc), f"{pc} is missing: run make (BUILD={BUILD})"
    path = os.pathsep.join(p for p in (BUILD, os.environ.get("PKG_CONFIG_PATH")) if p)
    r = subprocess.run(["pkg-config", *args, "idem"], capture_output=True, text=True,
                       env=dict(os.environ, PKG_CONFIG_PATH=path), timeout=30)
    assert r.returncode == 0, f"pkg-config {' '.join(args)} idem failed: {r.stderr}"
    return shlex.split(r.stdout)


def build_prog(name, out_dir):
    """Compiles tests/integration/progs/NAME.c against the built libidem.so; returns its path.
    The compiler, its flags and the libraries are the build's own, from its uninstalled idem.pc:
    under `make sanitize` (build-san/) the program is instrumented like the library."""
    src = os.path.join(PROGS, name + ".c")
    out = os.path.join(str(out_dir), name)
    libdir = build_pkg_config("--variable=libdir")
    assert libdir == [BUILD], f"pkg-config found the idem.pc of {libdir}, not of {BUILD}"
    cmd = [*build_pkg_config("--variable=cc"), *build_pkg_config("--variable=cflags"), src,
           *build_pkg_config("--cflags", "--libs"), "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr}"
    return out


def as_program(consumer, argv):
    """Turns a Consumer made with consumers(..., start=False) into a run of another program
    (argv); the metrics helpers keep working if the program serves consumer.metrics_port."""
    consumer.argv = list(argv)
    return consumer


TRIGGER = """
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF {condition} THEN
        RAISE EXCEPTION '{name}: injected by the test' USING ERRCODE = '{code}';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER {name} BEFORE {events} ON {table} FOR EACH ROW EXECUTE FUNCTION {name}();
"""


def add_failure(db, table, code, name="it_fail", condition="true", events="INSERT OR UPDATE"):
    """A trigger on table raising SQLSTATE code when condition (PL/pgSQL, NEW in scope) holds."""
    db.execute(TRIGGER.format(name=name, condition=condition, code=code, table=table,
                              events=events))


def drop_failure(db, table, name="it_fail"):
    db.execute(f"DROP TRIGGER {name} ON {table}; DROP FUNCTION {name}()")


def log_lines(consumer, pattern):
    """Lines of the consumer's log matching the regular expression."""
    rx = re.compile(pattern)
    return [line for line in consumer.log().splitlines() if rx.search(line)]


def vm_hwm_kib(pid):
    """Peak resident set size (VmHWM) of a running process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


class FreezableProxy:
    """A TCP proxy (threads) in front of host:port. freeze_existing() stops forwarding, both ways,
    on every connection open at that moment, without closing any socket (a dead link: the peers
    see silence, not a reset); connections made afterwards are forwarded normally."""

    def __init__(self, host, port):
        self.upstream = (host, port)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.lsock.settimeout(0.2)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.conns = []  # [client socket, upstream socket, frozen Event]
        self.closing = threading.Event()
        self.accepted = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.closing.is_set():
            try:
                cli, _ = self.lsock.accept()
            except OSError:
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                cli.close()
                continue
            frozen = threading.Event()
            with self.lock:
                self.conns.append((cli, up, frozen))
                self.accepted += 1
            for a, b in ((cli, up), (up, cli)):
                threading.Thread(target=self._pump, args=(a, b, frozen), daemon=True).start()

    def _pump(self, src, dst, frozen):
        while not self.closing.is_set():
            if frozen.is_set():
                time.sleep(0.05)  # neither read nor close: the bytes stay where they are
                continue
            try:
                r, _, _ = select.select([src], [], [], 0.1)
                if not r:
                    continue
                if frozen.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
        if not frozen.is_set():
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def url(self, amqp_url):
        u = urllib.parse.urlsplit(amqp_url)
        return urllib.parse.urlunsplit(
            u._replace(netloc=f"{u.username}:{u.password}@127.0.0.1:{self.port}"))

    def freeze_existing(self):
        with self.lock:
            for _, _, frozen in self.conns:
                frozen.set()
            return len(self.conns)

    def reset_frozen_clients(self):
        """Resets (RST) the client side of every frozen connection and leaves its broker side
        open and silent: the daemon sees its link reset and reconnects at once, while the broker
        believes in the old connection until its heartbeat timeout."""
        n = 0
        with self.lock:
            for cli, _, frozen in self.conns:
                if frozen.is_set() and cli.fileno() >= 0:
                    with contextlib.suppress(OSError):
                        cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
                        cli.close()
                        n += 1
        return n

    def close(self):
        self.closing.set()
        self.thread.join(2)
        with self.lock:
            for cli, up, _ in self.conns:
                for s in (cli, up):
                    with contextlib.suppress(OSError):
                        s.close()
        self.lsock.close()
