"""No lock a role outside idem's can take stops idem. A login role that may only CONNECT takes
every advisory lock it can: the keys older idems used (7648 and 7649 with a subscription's hash,
7650 for migrate, 7651 for retain) and whatever advisory lock it sees in pg_locks while idem works,
and holds ACCESS SHARE on every idem table (pg_relation_size needs no privilege). idem_emit, the
relay, migrate (also on an empty database) and retain still complete within their bounds. When
the relay does wait for a lock (a role with rights on the outbox locks it), the lock timeout's
line names the holder (pid, role, application)."""

import json
import re
import threading
import time
import urllib.parse
import uuid

import psycopg2
import pytest

from conftest import admin_exec, new_id, payload, run_idem, wait_until
from relay_helpers import declare_consumer_queue, emit, read_queue, relay_daemons

__all__ = ["relay_daemons"]

OLD_KEYS = [(7650, 1), (7651, 1)]


def as_role(url, name):
    u = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(u._replace(netloc=f"{name}@{u.hostname}:{u.port}"))


class Griefer:
    """A role with nothing but CONNECT (PUBLIC's default), grabbing locks for as long as it
    lives: one session takes advisory locks (the old keys, then every one pg_locks shows other
    sessions holding, polled), another holds ACCESS SHARE on every relation of schema idem."""

    def __init__(self, servers, db_url, subs=()):
        self.name = f"it_outsider_{uuid.uuid4().hex[:8]}"
        self.servers = servers
        admin_exec(servers, f"CREATE ROLE {self.name} LOGIN")
        self.url = as_role(db_url, self.name)
        self.locks = psycopg2.connect(self.url, application_name="griefer")
        self.locks.autocommit = True
        self.taken = set()
        with self.locks.cursor() as cur:
            for a, b in OLD_KEYS:
                self.take(cur, a, b)
            for sub in subs:
                for k in (7648, 7649):
                    cur.execute("SELECT hashtext(%s)", (sub,))
                    self.take(cur, k, cur.fetchone()[0])
        self.shares = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._grab, daemon=True)
        self.thread.start()

    def take(self, cur, a, b):
        cur.execute("SELECT pg_try_advisory_lock(%s::int, %s::int)", (a, b))
        if cur.fetchone()[0]:
            self.taken.add((a, b))

    def hold_tables(self):
        """What it can hold of idem's relations, in a transaction left open: LOCK TABLE is refused
        (no privilege, no USAGE on schema idem); functions taking a relation by its oid take
        ACCESS SHARE (most let go of it at once, some keep it)."""
        with psycopg2.connect(self.url) as c, c.cursor() as cur:
            with pytest.raises(psycopg2.Error) as e:
                cur.execute("LOCK TABLE idem.event_outbox IN ACCESS SHARE MODE")
            assert e.value.pgcode == "42501", e.value.pgerror
        self.shares = psycopg2.connect(self.url, application_name="griefer-tables")
        with self.shares.cursor() as cur:
            cur.execute("SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = "
                        "c.relnamespace WHERE n.nspname = 'idem' AND c.relkind IN ('r', 'i')")
            oids = [r[0] for r in cur.fetchall()]
            for oid in oids:
                cur.execute("SELECT pg_relation_size(%s::oid), pg_indexes_size(%s::oid)",
                            (oid, oid))
        assert oids

    def _grab(self):
        conn = psycopg2.connect(self.url, application_name="griefer-poll")
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                while not self.stop.is_set():
                    cur.execute("SELECT DISTINCT classid::bigint, objid::bigint, objsubid "
                                "FROM pg_locks WHERE locktype = 'advisory' AND pid <> "
                                "pg_backend_pid()")
                    for classid, objid, sub in cur.fetchall():
                        if sub == 2:  # two int4 keys
                            a, b = classid, objid
                            a = a - (1 << 32) if a >= 1 << 31 else a
                            b = b - (1 << 32) if b >= 1 << 31 else b
                            if (a, b) not in self.taken:
                                cur.execute("SELECT pg_try_advisory_lock(%s::int, %s::int)", (a, b))
                                self.taken.add((a, b))
                        else:  # one int8 key
                            key = (classid << 32) | objid
                            key = key - (1 << 64) if key >= 1 << 63 else key
                            cur.execute("SELECT pg_try_advisory_lock(%s::bigint)", (key,))
                    time.sleep(0.02)
        finally:
            conn.close()

    def close(self):
        if self.stop.is_set():
            return
        self.stop.set()
        self.thread.join(5)
        for c in (self.locks, self.shares):
            if c is not None:
                c.close()
        admin_exec(self.servers, f"DROP OWNED BY {self.name}; DROP ROLE IF EXISTS {self.name}")


@pytest.fixture
def griefer(servers, db):
    made = []

    def make(url=None, subs=()):
        g = Griefer(servers, url or db.url, subs)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def test_migrate_with_an_outsider_holding_locks_also_on_an_empty_database(servers, griefer):
    name = "t_" + uuid.uuid4().hex[:16]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    try:
        url = servers.db_url(name)
        g = griefer(url)
        assert (7650, 1) in g.taken
        t0 = time.monotonic()
        r = run_idem("migrate", "--billing", pg_url=url, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "applied 016_followups_and_locks.sql" in r.stdout
        # again, with ACCESS SHARE on every idem table too: nothing to apply, nothing waited for
        g.hold_tables()
        r = run_idem("migrate", "--billing", pg_url=url, timeout=30)
        assert r.returncode == 0 and r.stdout.startswith("nothing to apply"), r.stdout + r.stderr
        assert time.monotonic() - t0 < 30
        assert g.thread.is_alive(), "the griefer kept polling"
        g.close()
    finally:
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_emit_relay_and_retain_with_an_outsider_holding_locks(db, servers, broker, queue,
                                                               griefer, relay_daemons):
    # no idem function takes an advisory lock any more (older idem_emits did)
    assert db.query("SELECT p.proname FROM pg_proc p WHERE p.pronamespace = 'idem'::regnamespace "
                    "AND p.prosrc ILIKE '%advisory%'") == []
    subs = [new_id() for _ in range(4)]
    g = griefer(subs=subs)
    assert (7651, 1) in g.taken and len(g.taken) == 2 + 2 * len(subs), g.taken
    g.hold_tables()
    declare_consumer_queue(broker, queue, ["payment.failed"])
    relay_daemons(name="relay", wait_ready=True)

    # idem_emit in the application's transactions, no lock_timeout of their own
    ids = []
    with db.connect(autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("SET statement_timeout = '20s'")
        for i in range(20):
            sub = subs[i % len(subs)]
            cur.execute("SELECT idem.idem_emit('payment.failed', %s::uuid, %s, %s::jsonb)::text",
                        (sub, f"pf:{sub}:{i}", json.dumps(payload(subscription_id=sub))))
            ids.append(cur.fetchone()[0])
            conn.commit()
    got = read_queue(broker, queue, expect=len(ids), timeout=30)
    assert sorted(m.event_id for m in got) == sorted(ids)
    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == len(ids), 15, 0.1,
               "every row marked sent")

    # retain runs (it is not skipped) and deletes what is old enough
    db.execute("UPDATE idem.event_outbox SET sent_at = now() - interval '8 days'")
    r = run_idem("retain", pg_url=db.url, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"event_outbox: deleted {len(ids)} rows in 1 batches" in r.stdout, r.stdout + r.stderr
    assert len(g.taken) >= 2 + 2 * len(subs)
    assert g.thread.is_alive(), "the griefer kept polling pg_locks"


def test_retain_lease_of_a_gone_backend_is_free(db):
    db.execute("UPDATE idem.idem_leases SET pid = 1, server_start = pg_postmaster_start_time(), "
               "taken_at = now() WHERE name = 'retain'")  # pid 1 is no backend
    r = run_idem("retain", pg_url=db.url, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("event_outbox: deleted 0 rows"), r.stdout + r.stderr
    assert db.query("SELECT pid FROM idem.idem_leases WHERE name = 'retain'") == [(None,)]


def test_relay_names_the_holder_of_a_lock_it_waited_for(db, servers, broker, queue,
                                                        relay_daemons):
    declare_consumer_queue(broker, queue, ["payment.failed"])
    sub = new_id()
    eid = emit(db, "payment.failed", sub, f"pf:{sub}", payload(subscription_id=sub))
    holder = psycopg2.connect(db.url, application_name="nightly-vacuum-script")
    try:
        with holder.cursor() as cur:
            cur.execute("LOCK TABLE idem.event_outbox IN EXCLUSIVE MODE")
            cur.execute("SELECT pg_backend_pid(), current_user")
            pid, role = cur.fetchone()
        relay = relay_daemons(args=["--lock-timeout", "2s"], name="relay", wait_ready=True)
        line = re.compile(rf"lock timeout.*it waited for a lock held by pid {pid} \(role {role}, "
                          rf"application nightly-vacuum-script\)")
        wait_until(lambda: line.search(relay.log()), 20, 0.1,
                   lambda: f"the lock timeout's line naming pid {pid}; log:\n{relay.log()[-2000:]}")
    finally:
        holder.close()
    got = read_queue(broker, queue, expect=1, timeout=20)
    assert [m.event_id for m in got] == [eid]
