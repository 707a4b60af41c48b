"""Every published message carries `x-idem-seq`, a 64-bit integer equal to its outbox row's seq,
strictly increasing per subscription in emit order, and handlers can read the subscription and
the seq (C: idem_event_subscription / idem_event_seq; SQL: the subscription_id argument and the
headers jsonb).

Without it a consumer outside idem's partitioned group (or an auditor) could not tell whether a
subscription's events arrive in emit order or detect a gap; a 32-bit encoding would wrap after
4 billion events (the test starts seq above 2^32, so a 32-bit header cannot carry it).

The headers a SQL handler receives: the contract's wire list is event_id, subscription_id,
event_type (strings), x-idem-seq (64-bit integer) and the emit's own string headers."""

import json
import signal

import pytest

from conftest import Daemon, finish_daemons, wait_until
from consumer_helpers import build_prog
from relay_helpers import declare_consumer_queue, emit_many, outbox, read_queue, relay_once

SEQ_START = 5_000_000_000  # above 2^32
SUBS = [f"00000000-0000-4000-8000-{i:012x}" for i in range(1, 4)]
PER_SUB = 4
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def emit_load(db):
    """4 events for each of 3 subscriptions, interleaved, seq above 2^32; the first one carries a
    traceparent header of its own. Returns {event_id: (sub, n)}."""
    db.execute(f"ALTER TABLE idem.event_outbox ALTER COLUMN seq RESTART WITH {SEQ_START}")
    events = [("payment.failed", s, f"{s}:{n}", {"invoice_id": s, "subscription_id": s,
                                                  "amount_cents": n, "currency": "USD", "n": n})
              for n in range(PER_SUB) for s in SUBS]
    first = events[0]
    first_id = db.scalar("SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb, %s::jsonb)::text",
                         first[0], first[1], first[2], json.dumps(first[3]),
                         json.dumps({"traceparent": TRACE}))
    ids = [first_id] + emit_many(db, events[1:])
    return {i: (e[1], e[3]["n"]) for i, e in zip(ids, events)}, first_id


def test_published_messages_carry_x_idem_seq(db, servers, broker, queue):
    declare_consumer_queue(broker, queue, ["payment.failed"])
    ids, first_id = emit_load(db)
    r = relay_once(db, servers)
    assert r.returncode == 0, r.stderr
    rows = outbox(db)
    got = read_queue(broker, queue, expect=len(ids))
    assert sorted(m.event_id for m in got) == sorted(ids)
    last = {}
    for m in got:
        seq = m.headers.get("x-idem-seq")
        assert isinstance(seq, int) and not isinstance(seq, bool), f"x-idem-seq of {m}: {seq!r}"
        assert seq == rows[m.event_id]["seq"] and seq > 2**32, (m, seq)
        assert seq > last.get(m.sub, 0), f"{m.sub}: seq {seq} after {last.get(m.sub)}"
        assert m.n == ids[m.event_id][1]
        last[m.sub] = seq
        assert m.headers["subscription_id"] == m.sub == ids[m.event_id][0]
    by_id = {m.event_id: m for m in got}
    assert by_id[first_id].headers["traceparent"] == TRACE
    # the wire type: pika decodes 'l' (64-bit signed) and 'I' (32-bit) both as int; a value
    # above 2^32 can only have come as 64 bits. An emit cannot set it itself:
    with pytest.raises(Exception, match="reserved"):
        db.scalar("SELECT idem.idem_emit('payment.failed', %s::uuid, 'k-reserved', '{}'::jsonb,"
                  " '{\"x-idem-seq\": \"1\"}'::jsonb)", SUBS[0])


@pytest.fixture(scope="module")
def seq_consumer_bin(tmp_path_factory):
    """tests/integration/progs/seq_consumer.c built against the build's libidem.so."""
    return build_prog("seq_consumer", tmp_path_factory.mktemp("progs"))


@pytest.fixture
def daemons(request):
    made = []
    yield made
    finish_daemons(made, request)


def test_c_handler_reads_subscription_and_seq(db, servers, broker, queue, seq_consumer_bin,
                                              daemons, tmp_path):
    db.execute("CREATE TABLE seen_c (event_id uuid PRIMARY KEY, subscription_id uuid, seq bigint)")
    declare_consumer_queue(broker, queue, ["payment.failed"])
    ids, _ = emit_load(db)
    assert relay_once(db, servers).returncode == 0
    d = Daemon("seq-c", [seq_consumer_bin, queue], db, servers, str(tmp_path))
    daemons.append(d)
    d.spawn()
    wait_until(lambda: db.count("seen_c") == len(ids), 20, 0.1,
               lambda: f"{len(ids)} events seen by the C handler (log: {d.log()[-500:]})")
    d.signal(signal.SIGTERM)
    assert d.wait_exit() == 0
    rows = outbox(db)
    for eid, sub, seq in db.query("SELECT event_id::text, subscription_id::text, seq FROM seen_c"):
        assert sub == ids[eid][0]
        assert seq == rows[eid]["seq"], f"{eid}: the handler read seq {seq}"


SQL_HANDLER = """
CREATE SCHEMA it;
CREATE TABLE it.seen (event_id uuid PRIMARY KEY, subscription_id uuid, headers jsonb);
CREATE FUNCTION it.record(p_event_id uuid, p_type text, p_sub uuid, p_payload jsonb,
                          p_headers jsonb) RETURNS void LANGUAGE sql AS $$
    INSERT INTO it.seen VALUES (p_event_id, p_sub, p_headers)
$$;
"""


def run_sql_handler(db, servers, broker, queue, consumers):
    db.execute(SQL_HANDLER)
    declare_consumer_queue(broker, queue, ["payment.failed"])
    ids, first_id = emit_load(db)
    assert relay_once(db, servers).returncode == 0
    c = consumers("seq-sql", queue, db, args=["--handler", "payment.failed=it.record"])
    wait_until(lambda: db.count("it.seen") == len(ids), 20, 0.1, "the SQL handler saw all")
    assert c.stop() == 0
    seen = {r[0]: (r[1], r[2]) for r in db.query(
        "SELECT event_id::text, subscription_id::text, headers FROM it.seen")}
    return ids, first_id, seen


def test_sql_handler_gets_subscription_and_string_headers(db, servers, broker, queue, consumers):
    ids, first_id, seen = run_sql_handler(db, servers, broker, queue, consumers)
    for eid, (sub, headers) in seen.items():
        assert sub == ids[eid][0]
        assert headers["event_id"] == eid and headers["subscription_id"] == sub
        assert headers["event_type"] == "payment.failed"
    assert seen[first_id][1]["traceparent"] == TRACE
    print(f"\nheaders jsonb a SQL handler gets: {seen[first_id][1]}")


def test_sql_handler_can_read_the_seq(db, servers, broker, queue, consumers):
    """The contract lists x-idem-seq among the message headers and gives SQL handlers the
    headers as jsonb; a SQL handler has no other way to read the seq."""
    ids, _, seen = run_sql_handler(db, servers, broker, queue, consumers)
    rows = outbox(db)
    for eid, (_, headers) in seen.items():
        assert "x-idem-seq" in headers, (f"x-idem-seq is not in the headers jsonb a SQL handler "
                                         f"gets: {headers}")
        assert int(headers["x-idem-seq"]) == rows[eid]["seq"], headers
