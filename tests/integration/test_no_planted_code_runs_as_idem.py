"""No role, however it can create objects in other schemas, makes an idem function or `idem
migrate` run code of its own (contract, "Security").

The attacker is the application's role as it is often set up: a non-superuser that owns its
database, so it owns schema public and may set the database's default search_path. Before idem
is migrated it plants, in public, functions and operators that shadow pg_catalog's
(public.format(text, text) and (text, uuid) beat pg_catalog's variadic format; =, <> and friends
win over pg_catalog's once public comes first on the search_path, which it makes the database's
default) and that record current_user in a table. Then a superuser runs `idem migrate`, and
another role (a member of idem_emitter and idem_consumer) calls every idem function. Nothing may
be recorded: on an idem whose functions run with the caller's or public's search_path, the
planted code ran as the superuser (migrate) and as idem_emit's owner (SECURITY DEFINER)."""

import contextlib
import uuid

import psycopg2
import pytest

from conftest import admin_exec, run_idem

# Planted by the attacker in public. rec() logs who ran it; each shadowing function or operator
# logs and then does what pg_catalog's would. They are declared IMMUTABLE (the log is written by
# the volatile rec), so that an index predicate or CHECK can be built on them unnoticed.
PLANT = r"""
CREATE TABLE public.planted_log (who text, what text);
GRANT INSERT, SELECT ON public.planted_log TO PUBLIC;
CREATE FUNCTION public.rec(w text) RETURNS void LANGUAGE sql
    AS $$ INSERT INTO public.planted_log VALUES (current_user, w) $$;
CREATE FUNCTION public.format(f text, a text) RETURNS text LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('format(text,text)'); RETURN pg_catalog.format(f, a); END $$;
CREATE FUNCTION public.format(f text, a uuid) RETURNS text LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('format(text,uuid)'); RETURN pg_catalog.format(f, a); END $$;
CREATE FUNCTION public.md5(a text) RETURNS text LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('md5(text)'); RETURN pg_catalog.md5(a); END $$;
CREATE FUNCTION public.current_setting(a text, b boolean) RETURNS text LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('current_setting'); RETURN pg_catalog.current_setting(a, b); END $$;
CREATE FUNCTION public.p_eq_name(a name, b name) RETURNS boolean LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('=(name,name)'); RETURN pg_catalog.nameeq(a, b); END $$;
CREATE OPERATOR public.= (LEFTARG = name, RIGHTARG = name, FUNCTION = public.p_eq_name);
CREATE FUNCTION public.p_eq_text(a text, b text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('=(text,text)'); RETURN pg_catalog.texteq(a, b); END $$;
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.p_eq_text);
CREATE FUNCTION public.p_ne_text(a text, b text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('<>(text,text)'); RETURN pg_catalog.textne(a, b); END $$;
CREATE OPERATOR public.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = public.p_ne_text);
CREATE FUNCTION public.p_eq_int84(a bigint, b integer) RETURNS boolean LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('=(bigint,integer)'); RETURN pg_catalog.int84eq(a, b); END $$;
CREATE OPERATOR public.= (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = public.p_eq_int84);
CREATE FUNCTION public.p_minus(a bigint, b bigint) RETURNS bigint LANGUAGE plpgsql IMMUTABLE
    AS $$ BEGIN PERFORM public.rec('-(bigint,bigint)'); RETURN pg_catalog.int8mi(a, b); END $$;
CREATE OPERATOR public.- (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.p_minus);
"""


@pytest.fixture
def owned_db(servers):
    """A database owned by a fresh non-superuser role (the attacker), with its plants in public
    and search_path = public, pg_catalog as the database's default; and a caller role that is a
    member of idem's emitter and consumer roles (granted after the migration made them)."""
    tag = uuid.uuid4().hex[:10]
    app, caller, name = f"app_{tag}", f"caller_{tag}", f"planted_{tag}"
    admin_exec(servers, f'CREATE ROLE "{app}" LOGIN')
    admin_exec(servers, f'CREATE ROLE "{caller}" LOGIN')
    admin_exec(servers, f'CREATE DATABASE "{name}" OWNER "{app}"')
    base = servers.db_url(name)
    as_app = base.replace("postgresql://postgres@", f"postgresql://{app}@", 1)
    assert as_app != base, base
    conn = psycopg2.connect(as_app)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(PLANT)
            cur.execute(f'ALTER DATABASE "{name}" SET search_path = public, pg_catalog')
    finally:
        conn.close()
    yield {"url": base, "app": app, "caller": caller,
           "as_caller": base.replace("postgresql://postgres@", f"postgresql://{caller}@", 1)}
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    for r in (caller, app):
        with contextlib.suppress(Exception):
            admin_exec(servers, f'DROP OWNED BY "{r}"')
        with contextlib.suppress(Exception):
            admin_exec(servers, f'DROP ROLE IF EXISTS "{r}"')


def planted_log(url):
    # pg_catalog only: the check itself must not run the plants
    conn = psycopg2.connect(url, options="-csearch_path=pg_catalog")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT who, what FROM public.planted_log")
            return sorted(set(cur.fetchall()))
    finally:
        conn.close()


def call(conn, sql, *args):
    """Runs sql in its own transaction; an error (the functions refuse some calls) is fine, only
    what ran matters here."""
    with conn.cursor() as cur:
        try:
            cur.execute(sql, args or None)
            conn.commit()
        except psycopg2.Error:
            conn.rollback()


def test_plants_run_neither_in_migrate_nor_in_idem_functions(owned_db, servers):
    url = owned_db["url"]
    # the plants are live: a statement on the database's default search_path runs them
    conn = psycopg2.connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT format('%s', 'x'::text)")
    conn.close()
    assert planted_log(url) == [("postgres", "format(text,text)")]
    admin = psycopg2.connect(url, options="-csearch_path=pg_catalog")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute("TRUNCATE public.planted_log")

    # a superuser migrates
    r = run_idem("migrate", pg_url=url, amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stdout + r.stderr
    in_migrate = planted_log(url)

    with admin.cursor() as cur:
        cur.execute("SELECT pronamespace::regnamespace::text FROM pg_catalog.pg_proc "
                    "WHERE proname OPERATOR(pg_catalog.=) 'idem_emit'")
        schema = cur.fetchone()[0]
        cur.execute(f'GRANT idem_emitter, idem_consumer TO "{owned_db["caller"]}"')
        cur.execute("TRUNCATE public.planted_log")
    admin.close()

    # another role calls every idem function, on the database's default search_path
    s = schema
    sub = str(uuid.uuid4())
    conn = psycopg2.connect(owned_db["as_caller"])
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW search_path")
            assert cur.fetchone()[0] == "public, pg_catalog"
        conn.commit()
        emit = f"SELECT {s}.idem_emit(%s, %s::uuid, %s, %s::jsonb)"
        call(conn, emit, "planted.test", sub, "key-1", '{"a": 1}')
        call(conn, emit, "planted.test", sub, "key-1", '{"a": 1}')  # a replay
        call(conn, emit, "planted.other", sub, "key-1", '{"a": 1}')  # 23505, with its DETAIL
        call(conn, f"SELECT {s}.idem_emit(%s, %s::uuid, %s, %s::jsonb, %s::jsonb)",
             "planted.test", sub, "key-2", '{"a": 2}', '{"traceparent": "00-x"}')
        call(conn, f"SELECT {s}.idem_claim_check(1::bigint, 1)")
        call(conn, f"SELECT {s}.idem_claim_check(1::bigint, 2)")
        call(conn, f"SELECT {s}.idem_stale_before(86400000::bigint)")
        # the claim guard and its commit check, as the consumer runtime drives them
        call(conn, f"SELECT pg_catalog.set_config('idem.claim', 'on', true), "
                   f"pg_catalog.set_config('idem.search_path', "
                   f"pg_catalog.current_setting('search_path'), true); "
                   f"INSERT INTO {s}.idem_claim_guard (pid) VALUES (pg_catalog.pg_backend_pid()) "
                   f"ON CONFLICT (pid) DO UPDATE SET uses = 1; "
                   f"SELECT {s}.idem_claim_commit(pg_catalog.current_setting('search_path'))")
        call(conn, f"INSERT INTO {s}.idem_claim_guard (pid) VALUES (pg_catalog.pg_backend_pid()) "
                   f"ON CONFLICT (pid) DO UPDATE SET uses = 2")  # the guard refuses this COMMIT
    finally:
        conn.close()
    in_functions = planted_log(url)
    assert (in_migrate, in_functions) == ([], []), \
        f"planted code ran (who, what): in idem migrate {in_migrate}, in idem functions {in_functions}"
