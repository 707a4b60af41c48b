"""`idem migrate` applies the sql/ migrations once; a second run applies nothing and exits 0."""

import os
import uuid

import pytest

from conftest import REPO, admin_exec, run_idem

TABLES = {"consumed_events", "event_outbox", "dunning", "revenue_entries", "receipts"}


@pytest.fixture
def empty_db(servers):
    name = "m_" + uuid.uuid4().hex[:12]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    yield servers.db_url(name)
    admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def snapshot(url):
    import psycopg2
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT table_name, column_name, data_type FROM information_schema.columns "
                        "WHERE table_schema = 'public' ORDER BY 1, 2")
            cols = cur.fetchall()
            cur.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1")
            idx = cur.fetchall()
            cur.execute("SELECT proname FROM pg_proc WHERE proname = 'idem_emit'")
            fn = cur.fetchall()
        return cols, idx, fn
    finally:
        conn.close()


def test_migrate_twice(empty_db, servers):
    migrations = sorted(f for f in os.listdir(os.path.join(REPO, "sql")) if f.endswith(".sql"))
    assert migrations

    r1 = run_idem("migrate", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r1.returncode == 0, r1.stderr
    for m in migrations:  # it prints what it applied
        assert m in r1.stdout, r1.stdout
    first = snapshot(empty_db)
    assert TABLES <= {c[0] for c in first[0]}
    assert first[2] == [("idem_emit",)]

    r2 = run_idem("migrate", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r2.returncode == 0, r2.stderr
    for m in migrations:  # and nothing the second time
        assert m not in r2.stdout, r2.stdout
    assert snapshot(empty_db) == first


def test_migrate_unreachable_database_exits_1_with_one_line(servers):
    r = run_idem("migrate", pg_url="postgresql://postgres:sekret@127.0.0.1:1/idem",
                 amqp_url=servers.amqp_url, timeout=20)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("idem migrate: cannot connect to PostgreSQL at 127.0.0.1:1"), lines[0]
    assert "sekret" not in r.stderr
