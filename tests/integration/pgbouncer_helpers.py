"""A private PgBouncer (Debian package `pgbouncer`) in front of a test's database.

Its config and auth file live in a temporary directory; it listens on a free loopback port,
runs as user postgres when the tests run as root (it refuses to run as root), stays in the
foreground with its log in that directory, and is always stopped by the fixture."""

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import urllib.parse

import psycopg2
import pytest

from conftest import free_port, wait_until
from idem_harness import die_with_parent as _die_with_parent

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class PgBouncer:
    def __init__(self, db_url, pool_mode="session", pool_size=1, extra=None):
        u = urllib.parse.urlsplit(db_url)
        self.dbname = u.path.lstrip("/")
        self.user = u.username or "postgres"
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="idem-pgbouncer.", dir="/tmp")
        os.chmod(self.dir, 0o755)
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": os.path.join(self.dir, "userlist.txt"),
            "pool_mode": pool_mode,
            "default_pool_size": str(pool_size),
            "max_client_conn": "50",
            "server_reset_query": "",
            "server_reset_query_always": "0",
            "ignore_startup_parameters": "extra_float_digits",
            "logfile": "",
            "pidfile": "",
        }
        settings.update(extra or {})
        lines = ["[databases]",
                 f"{self.dbname} = host={u.hostname} port={u.port or 5432} dbname={self.dbname}"
                 f" user={self.user}",
                 "", "[pgbouncer]"]
        lines += [f"{k} = {v}" for k, v in settings.items()]
        self.ini = os.path.join(self.dir, "pgbouncer.ini")
        with open(self.ini, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(settings["auth_file"], "w") as f:
            f.write(f'"{self.user}" ""\n')
        for p in (self.ini, settings["auth_file"]):
            os.chmod(p, 0o644)
        self.logpath = os.path.join(self.dir, "pgbouncer.log")
        self.proc = None
        self.url = urllib.parse.urlunsplit(
            u._replace(netloc=f"{self.user}@127.0.0.1:{self.port}"))

    def start(self):
        argv = [PGBOUNCER, self.ini]
        if os.geteuid() == 0:
            pwd.getpwnam("postgres")
            argv = ["runuser", "-u", "postgres", "--", *argv]
        self.log_f = open(self.logpath, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log_f,
                                     stderr=subprocess.STDOUT, cwd=self.dir,
                                     preexec_fn=_die_with_parent)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"pgbouncer exited with {self.proc.returncode}:\n"
                                     f"{self.log()}")
            with contextlib.suppress(psycopg2.OperationalError):
                psycopg2.connect(self.url, connect_timeout=2).close()
                return True
            return False

        wait_until(up, 15, 0.1, "pgbouncer accepting connections")
        return self

    def log(self):
        try:
            with open(self.logpath, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def connect(self):
        conn = psycopg2.connect(self.url, connect_timeout=5)
        conn.autocommit = True
        return conn

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            # runuser passes SIGTERM on to pgbouncer; SIGKILL if it does not go
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(Exception):
            self.log_f.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def pgbouncers(request):
    """Factory: pgbouncers(db_url, pool_mode='session', pool_size=1, extra=None) -> a started
    PgBouncer; every one is stopped after the test (its log printed if the test failed)."""
    if not os.path.exists(PGBOUNCER):
        pytest.fail("pgbouncer is missing: install it (scripts/deps.sh)")
    made = []

    def make(db_url, **kw):
        b = PgBouncer(db_url, **kw)
        made.append(b)
        return b.start()

    yield make
    rep = getattr(request.node, "rep_call", None)
    for b in made:
        if rep is not None and rep.failed:
            print(f"\n----- pgbouncer log ({b.dir}):\n{b.log()[-4000:]}")
        b.stop()


__all__ = ["PgBouncer", "pgbouncers"]
