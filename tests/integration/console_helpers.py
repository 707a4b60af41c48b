"""Helpers for the console's tests: a running `idem console` on a private port, and plain
urllib requests to it (no cookies, nothing but the standard library)."""

import json
import os
import urllib.error
import urllib.request

import pytest

from conftest import IDEM, Daemon, finish_daemons, free_port, wait_until

TOKEN = "t0ken-of-the-console-0123456789"


class Console(Daemon):
    def __init__(self, db, servers, workdir, queues=(), token=True, args=()):
        self.port = free_port()
        self.token = TOKEN if token else None
        argv = [IDEM, "console", "--listen", f"127.0.0.1:{self.port}", *args]
        for q in queues:
            argv += ["--queue", q]
        if token:
            path = os.path.join(workdir, f"console-token-{self.port}")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(TOKEN + "\n")
            argv += ["--token-file", path]
        super().__init__(f"console-{self.port}", argv, db, servers, workdir)
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self):
        self.spawn()

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"idem console exited {self.proc.returncode}:\n{self.log()}")
            try:
                return self.get("/api/config")[0] == 200
            except OSError:
                return False

        wait_until(up, 15, 0.1, "the console answering")
        return self

    def request(self, method, path, body=None, token="default", headers=None, raw=None):
        """(status, headers, body bytes); body is JSON-encoded, raw is sent as it is."""
        h = dict(headers or {})
        if token == "default":
            token = self.token
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                            else None)
        if data is not None:
            h.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def get(self, path):
        return self.request("GET", path, token=None)

    def json(self, path):
        status, _, body = self.get(path)
        assert status == 200, (status, body)
        return json.loads(body)

    def post(self, path, body, **kw):
        status, _, data = self.request("POST", path, body, **kw)
        return status, json.loads(data) if data else None


@pytest.fixture
def consoles(servers, tmp_path, request):
    """Factory: consoles(db, queues=[...], token=True, args=[...]) -> a started Console."""
    started = []

    def make(db, queues=(), token=True, args=()):
        c = Console(db, servers, str(tmp_path), queues, token, args)
        started.append(c)
        return c.start()

    yield make
    finish_daemons(started, request)
