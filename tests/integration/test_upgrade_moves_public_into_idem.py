"""A database migrated by an older idem (every object in public, tracked in
public.idem_schema_migrations) is moved into schema idem by the next `idem migrate`, its billing
tables into schema billing (contract, "Commands": migrate). The old layout is made the old way:
the migrations of commit 1202fcf (the last idem with objects in public), applied with their
record as that idem's migrate kept it; with pending events, ledger rows and billing rows in it.
After the move every row is where it was, nothing of idem's is left in public, and relay,
consumer and emit work on it through connections whose search_path is empty."""

import json
import os
import subprocess
import uuid

import psycopg2
import pytest

from conftest import REPO, Db, admin_exec, finish_daemons, new_id, payload, run_idem, wait_until
from relay_helpers import RelayDaemon, md5_uuid

OLD = "1202fcf"
# the migrations an install of OLD lacks (010_schema_idem.sql, the move, and those after it)
AFTER_009 = sorted(f for f in os.listdir(os.path.join(REPO, "sql")) if f.endswith(".sql")
                   and f >= "010")


def old_migrations():
    try:
        names = subprocess.run(["git", "-C", REPO, "ls-tree", "--name-only", OLD, "sql/"],
                               capture_output=True, text=True, check=True).stdout.split()
        return [(n.split("/")[-1], subprocess.run(["git", "-C", REPO, "show", f"{OLD}:{n}"],
                                                  capture_output=True, text=True,
                                                  check=True).stdout)
                for n in sorted(names) if n.endswith(".sql")]
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"needs the git history of the checkout (commit {OLD}): {e}")


def empty_path(url):
    return url + ("&" if "?" in url else "?") + "options=-csearch_path%3D"


@pytest.fixture
def old_db(servers):
    name = "up_" + uuid.uuid4().hex[:12]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    url = servers.db_url(name)
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:  # what the older idem's migrate did, file by file
            cur.execute("CREATE TABLE IF NOT EXISTS idem_schema_migrations (version text PRIMARY "
                        "KEY, applied_at timestamptz NOT NULL DEFAULT now())")
            conn.commit()
            for version, sql in old_migrations():
                cur.execute(sql)
                cur.execute("INSERT INTO idem_schema_migrations (version) VALUES (%s)", (version,))
                conn.commit()
    finally:
        conn.close()
    yield url
    admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def public_objects(db):
    return db.query("""
        SELECT c.relname::text, c.relkind::text FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace
        UNION ALL
        SELECT p.proname::text, 'function' FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
        UNION ALL
        SELECT t.typname::text, 'type' FROM pg_type t WHERE t.typnamespace = 'public'::regnamespace""")


def test_older_install_moved_into_idem_and_working(old_db, servers, broker, queue, consumers,
                                                    tmp_path, request):
    db = Db(old_db)
    assert db.scalar("SELECT to_regclass('public.event_outbox')::text") == "event_outbox"
    # the older idem's state: pending events, an applied one in the ledger and its effect
    sub_a, sub_b, inv = new_id(), new_id(), new_id()
    applied = db.scalar("SELECT idem_emit('payment.failed', %s::uuid, %s, %s::jsonb)::text",
                        sub_a, f"pf:{sub_a}:0", json.dumps(payload(subscription_id=sub_a)))
    db.execute("UPDATE event_outbox SET status = 'sent', sent_at = now()")
    db.execute("INSERT INTO consumed_events (consumer, event_id) VALUES ('billing', %s)", applied)
    db.execute("INSERT INTO dunning (subscription_id, step, last_event_id) VALUES (%s, 1, %s)",
               sub_a, applied)
    body_b = payload(subscription_id=sub_b, invoice_id=inv, amount_cents=700)
    pending = [
        db.scalar("SELECT idem_emit('payment.failed', %s::uuid, %s, %s::jsonb)::text", sub_a,
                  f"pf:{sub_a}:{i}", json.dumps(payload(subscription_id=sub_a)))
        for i in (1, 2)]
    pending.append(db.scalar("SELECT idem_emit('invoice.paid', %s::uuid, %s, %s::jsonb)::text",
                             sub_b, f"invoice:{inv}:paid", json.dumps(body_b)))
    before = {t: db.scalar(f"SELECT count(*) FROM public.{t}")
              for t in ("event_outbox", "consumed_events", "idem_emitted_keys", "dunning",
                        "idem_schema_migrations")}
    assert before["event_outbox"] == 4 and before["idem_emitted_keys"] == 4

    st = run_idem("migrate", "--status", pg_url=old_db)
    assert st.returncode == 1 and "pending 010_schema_idem.sql" in st.stdout, st.stdout

    r = run_idem("migrate", pg_url=old_db, amqp_url=servers.amqp_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("applied 010_schema_idem.sql (moved"), r.stdout

    # every row survived, in its new schema; public holds nothing of idem's
    assert public_objects(db) == []
    for t, n in before.items():
        schema = "billing" if t == "dunning" else "idem"
        # 010 and what follows it, and billing/001, recorded
        extra = len(AFTER_009) + 1 if t == "idem_schema_migrations" else 0
        assert db.scalar(f"SELECT count(*) FROM {schema}.{t}") == n + extra, t
    assert db.scalar("SELECT count(*) FROM idem.event_outbox WHERE status = 'pending'") == 3
    assert run_idem("migrate", "--status", "--billing", pg_url=old_db).returncode == 0
    r = run_idem("migrate", "--billing", pg_url=old_db, amqp_url=servers.amqp_url)
    assert r.returncode == 0 and r.stdout.startswith("nothing to apply"), r.stdout + r.stderr

    # relay, consumer, emit work on it, none of them with anything on their search_path
    plain = Db(empty_path(old_db))
    assert plain.scalar("SELECT current_setting('search_path')") == ""
    c = consumers("billing", queue, plain)
    relay = RelayDaemon(plain, servers, str(tmp_path), name="relay")
    try:
        relay.start(wait_ready=True)
        receipt = md5_uuid(f"idem:{pending[-1]}:receipt")
        wait_until(lambda: db.scalar("SELECT count(*) FROM idem.consumed_events") == 5, 30, 0.1,
                   lambda: f"the pending events and the receipt applied "
                           f"(ledger {db.ledger()})")
        assert db.dunning_step(sub_a) == 3
        assert db.query("SELECT invoice_id::text, amount_cents FROM billing.revenue_entries") == [
            (inv, 700)]
        assert db.query("SELECT event_id::text FROM billing.receipts") == [(receipt,)]
        # a replay of an old key still collapses into its event
        r = run_idem("emit", "--type", "payment.failed", "--subscription", sub_a, "--key",
                     f"pf:{sub_a}:1", "--payload", json.dumps(payload(subscription_id=sub_a)),
                     pg_url=plain.url)
        assert r.returncode == 0 and r.stdout.strip() == pending[0], r.stdout + r.stderr
        r = run_idem("emit", "--type", "payment.failed", "--subscription", sub_a, "--key",
                     f"pf:{sub_a}:3", "--payload", json.dumps(payload(subscription_id=sub_a)),
                     pg_url=plain.url)
        assert r.returncode == 0, r.stderr
        wait_until(lambda: db.dunning_step(sub_a) == 4, 20, 0.1, "the new event applied")
        assert c.metric("idem_consumer_dead_lettered_total") == 0
        assert c.stop() == 0
        assert relay.stop() == 0
    finally:
        finish_daemons([relay], request)
    assert db.ledger("billing") == sorted(
        ("billing", e) for e in [applied, *pending, receipt, r.stdout.strip()])
