"""The relay's settings do not leak to other clients of a pooled connection
(src/relay/relay_claim.c: synchronous_commit, plan_cache_mode, jit, enable_sort, lock_timeout and
statement_timeout are set with set_config(..., true), local to each transaction).

Behind a connection pooler the server connection the relay used is handed to the next client.
A plain SET (session level) would survive there: the billing application's next client would
commit with synchronous_commit off (a committed payment lost in a crash), run with the relay's
lock and statement timeouts (its long report queries cancelled at 30 s), or with generic plans
and no JIT. PgBouncer runs here in session pooling mode with no reset query at all
(server_reset_query empty, server_reset_query_always 0), so whatever a client leaves behind is
seen by the next one. The pool has 2 server connections, the number `idem relay --once` holds at
once (one per in-flight batch), so the checks below run on exactly the server connections the
relay used. `idem consume` works through the same pooler and leaves nothing behind either.
"""

import contextlib

from conftest import new_id, payload, run_idem, wait_until
from pgbouncer_helpers import pgbouncers
from relay_helpers import declare_consumer_queue, emit_many, outbox, read_queue

__all__ = ["pgbouncers"]

TYPE = "payment.failed"
SETTINGS = ("synchronous_commit", "plan_cache_mode", "lock_timeout", "statement_timeout", "jit",
            "enable_sort")
POOL = 2


def show_all(conn):
    out = {}
    with conn.cursor() as cur:
        for name in SETTINGS:
            cur.execute(f"SHOW {name}")
            out[name] = cur.fetchone()[0]
        cur.execute("SELECT pg_backend_pid()")
        out["pid"] = cur.fetchone()[0]
    return out


def pooled_sessions(bouncer):
    """The settings seen on every server connection of the pool (POOL clients at once, so each
    gets a different one)."""
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(contextlib.closing(bouncer.connect())) for _ in range(POOL)]
        return [show_all(c) for c in conns]


def test_relay_and_consumer_leave_no_settings_on_pooled_connections(db, servers, queue, broker,
                                                                    consumers, pgbouncers):
    dbname = db.scalar("SELECT current_database()")
    # The test server runs with synchronous_commit off; the database's own default is made 'on'
    # so that a leaked 'off' can be seen.
    db.execute(f'ALTER DATABASE "{dbname}" SET synchronous_commit = on')
    with db.connect() as direct:
        expected = show_all(direct)
    del expected["pid"]
    assert expected["synchronous_commit"] == "on"
    assert expected["plan_cache_mode"] == "auto"
    assert expected["lock_timeout"] == "0" and expected["statement_timeout"] == "0"
    assert expected["jit"] in ("on", "off")
    assert expected["enable_sort"] == "on"

    bouncer = pgbouncers(db.url, pool_mode="session", pool_size=POOL)
    before = pooled_sessions(bouncer)
    pids = {s["pid"] for s in before}
    assert len(pids) == POOL
    assert all({k: v for k, v in s.items() if k != "pid"} == expected for s in before), before

    # The relay through the pooler: two batches, so both of its connections run transactions.
    declare_consumer_queue(broker, queue, [TYPE])
    subs = [new_id() for _ in range(6)]
    ids = emit_many(db, [(TYPE, s, f"k:{s}", payload(subscription_id=s)) for s in subs])
    r = run_idem("relay", "--once", "--batch", "3", "--log-level", "debug", pg_url=bouncer.url,
                 amqp_url=servers.amqp_url, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "published 6, failed attempts 0, parked 0", r.stdout
    assert all(v["status"] == "sent" for v in outbox(db).values())
    assert sorted(m.event_id for m in read_queue(broker, queue, expect=6)) == sorted(ids)

    after = pooled_sessions(bouncer)
    assert {s["pid"] for s in after} == pids, (
        f"the pool opened other server connections: {before} -> {after}")
    for s in after:
        leaked = {k: (s[k], expected[k]) for k in expected if s[k] != expected[k]}
        assert not leaked, (f"the relay's settings survived on server connection {s['pid']} "
                            f"(seen, expected): {leaked}")

    # The consumer through the same pooler (session mode): applies an event, leaves nothing.
    c = consumers("billing", queue, db, env={"IDEM_PG_URL": bouncer.url})
    sub = new_id()
    eid = broker.publish_event(TYPE, payload(subscription_id=sub))
    wait_until(lambda: ("billing", eid) in db.ledger("billing"), 15, 0.1,
               lambda: f"the event applied through pgbouncer\n{c.log()[-2000:]}")
    assert db.dunning_step(sub) == 1
    assert c.stop() == 0

    after = pooled_sessions(bouncer)
    assert {s["pid"] for s in after} == pids
    for s in after:
        leaked = {k: (s[k], expected[k]) for k in expected if s[k] != expected[k]}
        assert not leaked, (f"the consumer's settings survived on server connection "
                            f"{s['pid']} (seen, expected): {leaked}")
