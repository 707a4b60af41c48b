"""CLI errors: an unknown flag or bad value is one line on stderr and exit 2; a one-shot command
that cannot reach its server exits 1 (status: 3) with one line naming the server, password
masked."""

import re

import pytest

from conftest import new_id, run_idem
from ops_helpers import add_outbox, closed_port, idem, stderr_line

COMMANDS = {
    "migrate": [],
    "status": [],
    "failed": [],
    "replay": ["--all-failed"],
    "retain": [],
    "emit": ["--type", "payment.failed", "--subscription", "6f1c1e8e-0000-4000-8000-000000000001",
             "--key", "k1", "--payload", '{"a": 1}'],
    "relay": ["--once"],
    "consume": ["--consumer", "c", "--queue", "q"],
}
ONE_SHOT = ["migrate", "status", "failed", "replay", "retain", "emit", "relay"]


def assert_usage_error(r, cmd):
    assert r.returncode == 2, (cmd, r.returncode, r.stdout, r.stderr)
    line = stderr_line(r)
    assert line.startswith(f"idem {cmd}: "), line
    assert r.stdout == ""
    return line


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_unknown_flag(cmd):
    r = run_idem(cmd, *COMMANDS[cmd], "--no-such-flag", pg_url="host=127.0.0.1 port=1")
    line = assert_usage_error(r, cmd)
    assert "--no-such-flag" in line


def test_unknown_flag_before_the_command():
    r = run_idem("--no-such-flag", "status", pg_url="host=127.0.0.1 port=1")
    assert_usage_error(r, "status")


def test_unknown_command_and_no_command():
    for argv in (["frobnicate"], [], ["--pg", "host=x"]):
        r = run_idem(*argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and r.stdout == ""


@pytest.mark.parametrize("cmd,args", [
    ("retain", ["--outbox-keep", "30"]),           # a unit is required
    ("retain", ["--dedup-window", "1w"]),
    ("retain", ["--outbox-keep", "7D"]),
    ("retain", ["--dedup-window", "-30d"]),
    ("retain", ["--outbox-keep", "100ms"]),        # ms only where the contract allows it
    ("retain", ["--dedup-window=1.5d"]),
    ("status", ["--max-age", "90"]),
    ("status", ["--max-age", "m"]),
    ("replay", ["--all-failed", "--dedup-window", "30"]),
    ("consume", ["--consumer", "c", "--queue", "q", "--dedup-window", "30"]),
    ("relay", ["--once", "--poll-interval", "200"]),
    ("relay", ["--once", "--backoff-base", "1x"]),
])
def test_bad_duration(cmd, args):
    r = run_idem(cmd, *args, pg_url="host=127.0.0.1 port=1")
    line = assert_usage_error(r, cmd)
    flag = next(a for a in args if a.startswith("--") and a not in ("--once", "--all-failed",
                                                                    "--consumer", "--queue"))
    assert flag.split("=")[0] in line


@pytest.mark.parametrize("args", [["--batch", "0"], ["--batch", "abc"], ["--batch", "1e3"],
                                  ["--batch"], ["--force=yes"], ["stray"]])
def test_bad_retain_values(args):
    r = run_idem("retain", *args, pg_url="host=127.0.0.1 port=1")
    assert_usage_error(r, "retain")


def test_bad_global_values():
    for args in (["--log-level", "loud"], ["--log-format", "xml"], ["--exchange", ""]):
        r = run_idem("status", *args, pg_url="host=127.0.0.1 port=1")
        assert_usage_error(r, "status")


def test_global_flags_after_the_command(db, servers):
    add_outbox(db, 1, "pending")
    r = run_idem("status", "--json", "--pg", db.url, "--log-level", "warn",
                 pg_url="host=127.0.0.1 port=1")  # the flag wins over the environment
    assert r.returncode == 0, r.stderr
    assert '"pending":1' in r.stdout.replace(" ", "")
    r = run_idem("--pg", db.url, "failed", "--json", pg_url="host=127.0.0.1 port=1")
    assert r.returncode == 0, r.stderr


def test_help_lists_flags_with_defaults():
    r = run_idem("retain", "--help")
    assert r.returncode == 0
    for text in ("--outbox-keep", "7d", "--dedup-window", "30d", "--batch", "5000", "--force"):
        assert text in r.stdout
    r = run_idem("status", "--help")
    assert r.returncode == 0 and "--max-age" in r.stdout and "--json" in r.stdout
    r = run_idem("replay", "--help")
    assert r.returncode == 0 and "--event-id" in r.stdout and "--all-failed" in r.stdout
    r = run_idem("--help")
    assert r.returncode == 0
    for cmd in ("status", "failed", "replay", "retain"):
        assert re.search(rf"^\s+{cmd}\s", r.stdout, re.M), cmd


@pytest.mark.parametrize("cmd", ONE_SHOT)
@pytest.mark.parametrize("form", ["uri", "conninfo"])
def test_unreachable_postgres(cmd, form):
    port = closed_port()
    pg = (f"postgresql://u:secret@127.0.0.1:{port}/x" if form == "uri"
          else f"host=127.0.0.1 port={port} user=u password=secret dbname=x")
    r = run_idem(cmd, *COMMANDS[cmd], "--pg", pg, timeout=30)
    want = 3 if cmd == "status" else 1
    assert r.returncode == want, (r.returncode, r.stdout, r.stderr)
    line = stderr_line(r)
    assert line.startswith(f"idem {cmd}: cannot connect to PostgreSQL at 127.0.0.1:{port}: "), line
    assert "secret" not in r.stderr + r.stdout
    # the contract's line names HOST:PORT only; if any part of the conninfo is echoed, its
    # password must be masked
    if "u:" in line or "password" in line:
        assert "***" in line, line
    assert r.stdout == ""


def test_unreachable_postgres_password_masked_in_logs():
    """Even with debug logging, nothing prints the password."""
    port = closed_port()
    r = run_idem("retain", "--log-level", "debug",
                 "--pg", f"postgresql://u:secret@127.0.0.1:{port}/x", timeout=30)
    assert r.returncode == 1
    assert "secret" not in r.stderr + r.stdout
    assert f"127.0.0.1:{port}" in r.stderr


def test_unknown_database(servers):
    for cmd in ("failed", "retain", "replay"):
        r = run_idem(cmd, *COMMANDS[cmd], pg_url=servers.db_url("no_such_db_" + cmd))
        assert r.returncode == 1, (cmd, r.stderr)
        assert stderr_line(r).startswith(f"idem {cmd}: cannot connect to PostgreSQL at ")


def test_unreachable_rabbitmq_for_relay_once(db, servers):
    add_outbox(db, 1, "pending")  # something to publish
    port = closed_port()
    r = run_idem("relay", "--once", pg_url=db.url,
                 amqp_url=f"amqp://guest:secret@127.0.0.1:{port}", timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = stderr_line(r)
    assert line.startswith(f"idem relay: cannot connect to RabbitMQ at 127.0.0.1:{port}: "), line
    assert "secret" not in r.stderr + r.stdout
    assert db.count("idem.event_outbox", "status = 'pending'") == 1


def test_replay_invalid_uuid_is_usage_error(db, servers):
    for bad in ("not-a-uuid", new_id()[:-1], new_id() + "ff", "{" + new_id()):
        r = idem(db, servers, "replay", "--event-id", bad)
        assert_usage_error(r, "replay")
