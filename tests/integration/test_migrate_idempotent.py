"""`idem migrate` applies the sql/ migrations once, every object in schema idem (and, with
--billing, the bundled handlers' tables in schema billing), nothing anywhere else; a second run
applies nothing and exits 0. `--status` lists applied and pending migrations (exit 1 while some
are pending). A migration that fails names its file, and nothing of that file stays."""

import os
import shutil
import uuid

import psycopg2
import pytest

from conftest import REPO, admin_exec, run_idem

IDEM_TABLES = {"consumed_events", "event_outbox", "idem_emitted_keys", "idem_claim_guard",
               "idem_schema_migrations", "idem_emit_locks", "idem_relay_idle", "idem_migrate_lock",
               "idem_leases", "idem_consumer_roles"}
BILLING_TABLES = {"dunning", "revenue_entries", "receipts"}
CORE = sorted(f for f in os.listdir(os.path.join(REPO, "sql")) if f.endswith(".sql"))
BILLING = sorted("billing/" + f for f in os.listdir(os.path.join(REPO, "sql", "billing"))
                 if f.endswith(".sql"))


@pytest.fixture
def empty_db(servers):
    name = "m_" + uuid.uuid4().hex[:12]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    yield servers.db_url(name)
    admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def query(url, sql, *args):
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args or None)
            return cur.fetchall()
    finally:
        conn.close()


def objects(url):
    """(schema, name, kind) of every table, index, sequence, view, type, function and trigger
    outside the system schemas."""
    return sorted(query(url, """
        SELECT n.nspname, c.relname, c.relkind::text FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
        UNION ALL
        SELECT n.nspname, p.proname, 'function' FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
        UNION ALL
        SELECT n.nspname, t.typname, 'type' FROM pg_type t
          JOIN pg_namespace n ON n.oid = t.typnamespace
         WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
           AND t.typrelid = 0 AND t.typelem = 0
        UNION ALL
        SELECT n.nspname, g.tgname, 'trigger' FROM pg_trigger g
          JOIN pg_class c ON c.oid = g.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE NOT g.tgisinternal"""))


def snapshot(url):
    cols = query(url, "SELECT table_schema, table_name, column_name, data_type "
                      "FROM information_schema.columns WHERE table_schema IN ('idem', 'billing') "
                      "ORDER BY 1, 2, 3")
    return objects(url), cols


def status(url, *flags):
    r = run_idem("migrate", "--status", *flags, pg_url=url)
    return r.returncode, r.stdout.splitlines(), r.stderr


def test_migrate_twice_everything_in_schema_idem(empty_db, servers):
    assert CORE and BILLING
    rc, lines, err = status(empty_db)
    assert rc == 1, err
    assert lines == [f"pending {m}" for m in CORE]

    r1 = run_idem("migrate", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r1.returncode == 0, r1.stderr
    for m in CORE:  # it prints what it applied
        assert f"applied {m}" in r1.stdout, r1.stdout
    first = snapshot(empty_db)
    schemas = {o[0] for o in first[0]}
    assert schemas == {"idem"}, f"objects outside schema idem: {first[0]}"
    tables = {o[1] for o in first[0] if o[2] == "r"}
    assert tables == IDEM_TABLES
    assert ("idem", "idem_emit", "function") in first[0]
    assert query(empty_db, "SELECT nspname FROM pg_namespace WHERE nspname IN "
                           "('idem', 'billing')") == [("idem",)]

    assert status(empty_db)[:2] == (0, [f"applied {m}" for m in CORE])
    # --billing counts the bundled handlers' migrations too
    assert status(empty_db, "--billing")[:2] == (
        1, [f"applied {m}" for m in CORE] + [f"pending {m}" for m in BILLING])

    r2 = run_idem("migrate", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.startswith("nothing to apply"), r2.stdout
    assert snapshot(empty_db) == first

    # --billing later on an already-migrated database adds the billing tables, in schema billing
    r3 = run_idem("migrate", "--billing", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r3.returncode == 0, r3.stderr
    assert r3.stdout.splitlines() == [f"applied {m}" for m in BILLING]
    after = snapshot(empty_db)
    added = sorted(set(after[0]) - set(first[0]))
    assert {o[0] for o in added} == {"billing"}, added
    assert {o[1] for o in added if o[2] == "r"} == BILLING_TABLES
    assert status(empty_db, "--billing")[:2] == (0, [f"applied {m}" for m in CORE + BILLING])
    r4 = run_idem("migrate", "--billing", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r4.returncode == 0 and r4.stdout.startswith("nothing to apply"), r4.stdout + r4.stderr
    assert snapshot(empty_db) == after


def test_schema_idem_is_closed_to_other_roles(empty_db, servers):
    r = run_idem("migrate", "--billing", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stderr
    assert query(empty_db, "SELECT has_schema_privilege('public', 'idem', 'CREATE'), "
                           "has_schema_privilege('public', 'idem', 'USAGE'), "
                           "has_schema_privilege('public', 'billing', 'CREATE')") == [
        (False, False, False)]
    for role in ("idem_emitter", "idem_relay", "idem_consumer", "idem_operator"):
        assert query(empty_db, "SELECT has_schema_privilege(%s, 'idem', 'USAGE'), "
                               "has_schema_privilege(%s, 'idem', 'CREATE')", role, role) == [
            (True, False)], role
    assert query(empty_db, "SELECT has_schema_privilege('idem_consumer', 'billing', 'USAGE')")[0] \
        == (True,)
    # PUBLIC executes no idem function; every one pins its search_path, pg_catalog first
    rows = query(empty_db, """
        SELECT p.oid::regprocedure::text, p.proconfig,
               EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
          FROM pg_proc p WHERE p.pronamespace = 'idem'::regnamespace""")
    assert len(rows) >= 5, rows
    for sig, config, public_exec in rows:
        assert config == ["search_path=pg_catalog, idem, pg_temp"], (sig, config)
        assert not public_exec, f"PUBLIC may execute {sig}"


def test_failing_migration_names_its_file_and_leaves_nothing(empty_db, servers, tmp_path):
    sql = tmp_path / "sql"
    shutil.copytree(os.path.join(REPO, "sql"), sql)
    bad = "999_broken.sql"
    (sql / bad).write_text("CREATE TABLE idem.half_done (x int);\n"
                           "INSERT INTO idem.half_done VALUES (1);\n"
                           "SELECT 1 / 0;\n")
    r = run_idem("migrate", "--sql-dir", str(sql), pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"idem migrate: migration {bad} failed: "), lines[0]
    assert "division by zero" in lines[0], lines[0]
    for m in CORE:  # the ones before it are applied and stay
        assert f"applied {m}" in r.stdout, r.stdout
    assert query(empty_db, "SELECT to_regclass('idem.half_done')") == [(None,)]
    assert query(empty_db, "SELECT count(*) FROM idem.idem_schema_migrations WHERE version = %s",
                 bad) == [(0,)]
    rc, lines, _ = status(empty_db, "--sql-dir", str(sql))
    assert rc == 1 and lines[-1] == f"pending {bad}", lines


def test_migrate_refuses_a_schema_idem_made_by_another_role(empty_db, servers):
    """A role that could create schema idem before idem did would own what idem's functions and
    migrations find on their search_path: migrate refuses it."""
    tag = uuid.uuid4().hex[:8]
    role = f"squat_{tag}"
    admin_exec(servers, f'CREATE ROLE "{role}"')
    try:
        conn = psycopg2.connect(empty_db)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE SCHEMA idem AUTHORIZATION "{role}"')
        conn.close()
        r = run_idem("migrate", pg_url=empty_db, amqp_url=servers.amqp_url)
        assert r.returncode == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"owned by role {role}" in lines[0], r.stderr
        assert query(empty_db, "SELECT count(*) FROM pg_class WHERE relnamespace = "
                               "'idem'::regnamespace") == [(0,)]
    finally:
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{empty_db.rsplit("/", 1)[1]}" WITH (FORCE)')
        admin_exec(servers, f'DROP ROLE IF EXISTS "{role}"')


def test_migrate_unreachable_database_exits_1_with_one_line(servers):
    r = run_idem("migrate", pg_url="postgresql://postgres:sekret@127.0.0.1:1/idem",
                 amqp_url=servers.amqp_url, timeout=20)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("idem migrate: cannot connect to PostgreSQL at 127.0.0.1:1"), lines[0]
    assert "sekret" not in r.stderr


APP_TABLES = """
CREATE TABLE public.receipts (id serial PRIMARY KEY, order_ref text NOT NULL, sent boolean);
CREATE TABLE public.dunning (customer text PRIMARY KEY, level smallint, note text);
CREATE TABLE public.revenue_entries (entry_id bigint PRIMARY KEY, cents integer, booked date);
INSERT INTO public.receipts (order_ref, sent) VALUES ('A-1', true), ('A-2', false);
INSERT INTO public.dunning VALUES ('acme', 2, 'call them');
INSERT INTO public.revenue_entries VALUES (7, 1999, '2026-11-30');
"""


def test_migrate_leaves_the_applications_own_tables_alone(empty_db, servers):
    """An application that already has receipts, dunning and revenue_entries tables of its own
    (names the bundled billing handlers use too): `idem migrate --billing` creates idem's in
    schemas idem and billing and touches nothing of the application's: same columns, same rows,
    no trigger, index or grant added."""
    conn = psycopg2.connect(empty_db)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(APP_TABLES)
    conn.close()

    def app_state():
        cols = query(empty_db, "SELECT table_name, column_name, data_type, is_nullable FROM "
                               "information_schema.columns WHERE table_schema = 'public' "
                               "ORDER BY 1, 2")
        rows = [query(empty_db, f"SELECT * FROM public.{t} ORDER BY 1")
                for t in ("receipts", "dunning", "revenue_entries")]
        extra = query(empty_db, """
            SELECT c.relname, c.relkind, c.relacl::text,
                   (SELECT count(*) FROM pg_trigger g WHERE g.tgrelid = c.oid),
                   (SELECT count(*) FROM pg_index i WHERE i.indrelid = c.oid)
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'public' ORDER BY 1""")
        return cols, rows, extra

    before = app_state()
    r = run_idem("migrate", "--billing", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stderr
    assert app_state() == before
    assert {t for (t,) in query(empty_db, "SELECT table_name FROM information_schema.tables "
                                          "WHERE table_schema = 'billing'")} == BILLING_TABLES
    r = run_idem("migrate", "--billing", "--status", pg_url=empty_db, amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stdout + r.stderr
