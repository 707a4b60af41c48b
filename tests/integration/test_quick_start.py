"""The README's quick start works as written.

Every fenced `sh` block of README.md's "Quick start" section runs, in order, in one bash (so
what one block exports or starts in the background, the next one has), with `set -e`, in a copy
of the checkout (its files as they are now, README edits included, and its build/ with the
timestamps kept, so the quick start's `make` has nothing to do). The blocks start their own
private servers with scripts/dev-servers, in a folder of this test's own (IDEM_DEV_DIR); the
session's servers are not used. Between blocks the test only waits and looks:
- after the emits, until the quick start's own handler has applied its events (the effect in
  the database: the customer's loyalty points, 42 + 15, and one ledger row per distinct event;
  the replayed emit printed the same id and queued nothing);
- the block that looks at the table shows that row;
- the block that stops the daemons reports that both exited 0, and the last block stops the
  servers (nothing answers on their ports afterwards).
Whatever happens, the servers of the test's folder are stopped at the end.
"""

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse

import psycopg2
import pytest

from conftest import REPO

SERVICES_TIMEOUT = 240  # starting RabbitMQ on a loaded 2-core machine
BLOCK_TIMEOUT = 120
MARK = "__quick_start_block_done__"


def quick_start_blocks():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    m = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, re.M | re.S)
    assert m, 'README.md has no "## Quick start" section'
    blocks = re.findall(r"^```sh\n(.*?)^```", m.group(1), re.M | re.S)
    assert blocks, "no ```sh block in the quick start"
    return blocks


def copy_checkout(dst):
    """The checkout's files (tracked and new, not ignored) as they are in the work tree, and its
    build/ directory, with modification times kept."""
    r = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others",
                        "--exclude-standard"], capture_output=True)
    if r.returncode != 0:  # not a git checkout (a source tarball): everything but the builds
        shutil.copytree(REPO, dst, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", "build-*", "__pycache__", ".pytest_cache"))
        return
    for rel in filter(None, r.stdout.decode().split("\0")):
        src = os.path.join(REPO, rel)
        if not os.path.lexists(src):
            continue  # deleted in the work tree
        out = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.copy2(src, out, follow_symlinks=False)
    shutil.copytree(os.path.join(REPO, "build"), os.path.join(dst, "build"), symlinks=True)


class Shell:
    """One bash, fed block after block on stdin; its output (stdout and stderr) is collected."""

    def __init__(self, cwd, env, scratch):
        self.scratch = scratch  # where the inline commands' files go
        self.p = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=cwd, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.out = ""
        self.send("set -e\n")

    def send(self, text):
        self.p.stdin.write(text.encode())
        self.p.stdin.flush()

    def run(self, path, timeout):
        """Sources path; returns its output. Fails when the block fails (set -e ends the shell)."""
        start = len(self.out)
        self.send(f". {path}\necho {MARK}\n")
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while MARK + "\n" not in self.out[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"{path} did not finish within {timeout} s:\n{self.out[-6000:]}"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"{path} failed (exit {self.p.wait()}):\n{self.out[-6000:]}")
                self.out += chunk.decode(errors="replace")
        text = self.out[start:]
        return text[:text.index(MARK + "\n")]

    def value(self, expr):
        """The value of a shell expression in the session (e.g. "$IDEM_PG_URL")."""
        return self.run_inline(f'printf "%s\\n" "{expr}"').strip().splitlines()[-1]

    def run_inline(self, command):
        path = os.path.join(self.scratch, f"inline{len(self.out)}.sh")
        with open(path, "w") as f:
            f.write(command + "\n")
        return self.run(path, 30)

    def close(self):
        if self.p.poll() is None:
            # the shell and whatever it left running in the background (its own session)
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def port_answers(port):
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(pred, timeout, what, shell):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}:\n{shell.out[-6000:]}"
        time.sleep(0.3)


def points(url):
    try:
        with psycopg2.connect(url, connect_timeout=5) as conn, conn.cursor() as cur:
            cur.execute("SELECT customer::text, points FROM shop.points")
            return cur.fetchall()
    except psycopg2.Error:
        return None


def test_quick_start_runs_as_written(tmp_path):
    blocks = quick_start_blocks()
    work = tmp_path / "checkout"
    copy_checkout(str(work))
    # postgres must reach the servers' folder: under /tmp, traversable all the way
    dev_dir = f"/tmp/idem-quick-start-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("IDEM_") and not k.startswith("PG")}
    env.update(IDEM_DEV_DIR=dev_dir, PYTHONDONTWRITEBYTECODE="1")
    scripts = tmp_path / "blocks"
    scripts.mkdir()
    sh = Shell(str(work), env, str(scripts))
    try:
        emitted = looked = stopped = False
        for i, block in enumerate(blocks):
            path = scripts / f"block{i}.sh"
            path.write_text(block)
            if "dev-servers stop" in block or "kill $consumer" in block:
                # before the daemons stop: the handler applied everything, once
                assert emitted and looked, "the quick start stops before it showed the effect"
            timeout = SERVICES_TIMEOUT if "scripts/dev-servers" in block else BLOCK_TIMEOUT
            out = sh.run(str(path), timeout)
            if "idem emit" in block:
                ids = re.findall(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                                 out, re.M)
                assert len(ids) == 3 and ids[0] == ids[1] != ids[2], out
                url = sh.value("$IDEM_PG_URL")
                customer = sh.value("$customer")
                wait_for(lambda: points(url) == [(customer, 57)], 60,
                         "the quick start's handler did not apply both orders", sh)
                with psycopg2.connect(url) as conn, conn.cursor() as cur:
                    cur.execute("SELECT event_id::text FROM idem.consumed_events "
                                "WHERE consumer = 'shop' ORDER BY 1")
                    assert [r[0] for r in cur.fetchall()] == sorted(ids[1:])
                    cur.execute("SELECT count(*) FROM idem.event_outbox WHERE status = 'sent'")
                    assert cur.fetchone()[0] == 2
                emitted = True
            elif emitted and "TABLE shop.points" in block:
                assert re.search(rf"^ {customer} \|\s+57$", out, re.M), out
                looked = True
            elif "kill $consumer" in block:
                assert "stopped cleanly" in out, out
                stopped = True
        assert emitted and looked and stopped, "the quick start lacks an emit, a look or a stop"
        assert "dev-servers stop" in blocks[-1], "the quick start does not stop its servers"
        parsed = urllib.parse.urlparse(url)
        assert not port_answers(parsed.port), "PostgreSQL still answers after dev-servers stop"
    finally:
        sh.close()
        if os.path.isdir(dev_dir):
            subprocess.run([os.path.join(REPO, "scripts", "dev-servers"), "wipe"],
                           env=dict(env, IDEM_DEV_DIR=dev_dir), capture_output=True, timeout=180)
