"""Every daemon and one-shot command checks at start that the database is migrated to what it
needs; if not: one line naming `idem migrate`, exit 1 (contract, "Commands"). The bundled
billing handlers need `idem migrate --billing`."""

import os
import shutil
import uuid

import pytest

from conftest import REPO, Db, admin_exec, run_idem

SUB = "6f1c1e8e-0000-4000-8000-000000000001"
COMMANDS = {
    "status": [],
    "failed": [],
    "replay": ["--all-failed"],
    "retain": [],
    "emit": ["--type", "payment.failed", "--subscription", SUB, "--key", "k1",
             "--payload", '{"a": 1}'],
    "relay --once": ["--once"],
    "relay": [],
    "consume": ["--consumer", "c", "--queue", "it.schema_check.q"],
}


@pytest.fixture
def new_db(servers):
    made = []

    def make(migrations=None, billing=False, tmp=None):
        """A new database: migrations None = nothing at all; else the first `migrations` core
        files applied by `idem migrate --sql-dir` (all of them when True), and billing's."""
        name = "sc_" + uuid.uuid4().hex[:12]
        admin_exec(servers, f'CREATE DATABASE "{name}"')
        made.append(name)
        url = servers.db_url(name)
        if migrations is not None:
            sql = os.path.join(tmp, "sql-" + name)
            shutil.copytree(os.path.join(REPO, "sql"), sql)
            core = sorted(f for f in os.listdir(sql) if f.endswith(".sql"))
            if migrations is not True:
                for f in core[migrations:]:
                    os.unlink(os.path.join(sql, f))
            args = ["migrate", "--sql-dir", sql] + (["--billing"] if billing else [])
            r = run_idem(*args, pg_url=url)
            assert r.returncode == 0, r.stderr
        return url

    yield make
    for name in made:
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(cmd, url, servers):
    words = cmd.split()
    return run_idem(*words, *COMMANDS[cmd], pg_url=url, amqp_url=servers.amqp_url, timeout=30)


def the_line(r, cmd, needs="idem migrate"):
    """The exit status is 1 and stderr has exactly one line naming what to run: the last one
    (a daemon may have logged its start before it)."""
    assert r.returncode == 1, (cmd, r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    naming = [ln for ln in lines if "idem migrate" in ln]
    assert naming == [lines[-1]], (cmd, r.stderr)
    line = lines[-1]
    assert line.startswith(f"idem {cmd.split()[0]}: "), line
    assert line.endswith(f"run {needs}"), line
    if cmd in ("status", "failed", "replay", "retain", "emit", "relay --once"):
        assert len(lines) == 1, (cmd, r.stderr)
    return line


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_empty_database(new_db, servers, cmd):
    url = new_db()
    line = the_line(run(cmd, url, servers), cmd)
    assert "schema idem is missing" in line, line
    assert Db(url).scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'idem'") == 0


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_half_migrated_database(new_db, servers, cmd, tmp_path):
    url = new_db(migrations=5, tmp=str(tmp_path))
    line = the_line(run(cmd, url, servers), cmd)
    latest = sorted(f for f in os.listdir(os.path.join(REPO, "sql")) if f.endswith(".sql"))[-1]
    assert f"{latest} is not applied" in line, line


def test_bundled_handlers_need_the_billing_tables(new_db, servers, tmp_path):
    url = new_db(migrations=True, tmp=str(tmp_path))
    line = the_line(run("consume", url, servers), "consume", needs="idem migrate --billing")
    assert "billing/001_billing.sql" in line, line
    # the one-shot commands and the relay need no billing tables
    r = run("status", url, servers)
    assert r.returncode == 0, r.stderr
    r = run("relay --once", url, servers)
    assert r.returncode == 0, r.stderr
