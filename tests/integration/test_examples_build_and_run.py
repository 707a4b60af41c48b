"""The library as a user gets it: `make install DESTDIR=<tmp> PREFIX=/usr/local`, then programs
built with `cc X.c $(pkg-config --cflags --libs idem)` and nothing else.

- The README's handler example (the C block under "Writing handlers") compiles and links with
  pkg-config alone, applies a payment.failed once (also delivered twice) and exits 0 on SIGTERM.
- examples/emitter and examples/consumer build the same way, and run against the private
  servers with the installed `idem`: the emitter queues refunds (a replayed request collapses),
  `idem relay --once` publishes them, the example consumer's own refund.issued handler applies
  each exactly once, also when the consumer is killed between COMMIT and ack (the broker
  redelivers) and when a copy of an event is delivered again; SIGTERM stops it with exit 0
  after acking everything it took. The emitting request's `traceparent` reaches the handler
  (idem_emit_with_headers -> the relay -> idem_event_header) and is stored with the effect.
"""

import contextlib
import os
import re
import signal
import subprocess
import uuid

import pytest

from conftest import REPO, Daemon, Db, admin_exec, finish_daemons, new_id, wait_until
from install_helpers import staged  # noqa: F401  (fixture)

EXAMPLES = os.path.join(REPO, "examples")


def readme_handler_example():
    """The fenced C block of README.md's "Writing handlers" section."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    m = re.search(r"^## Writing handlers\n(.*?)(?=^## )", readme, re.M | re.S)
    assert m, 'README.md has no "## Writing handlers" section'
    block = re.search(r"^```c\n(.*?)^```", m.group(1), re.M | re.S)
    assert block, 'no ```c block under "Writing handlers"'
    return block.group(1)


def build(staged, src, out):
    """Builds src exactly as documented; fails with the compiler's output otherwise."""
    r = staged.cc(src, out)
    assert r.returncode == 0, f"cc {src} $(pkg-config --cflags --libs idem) failed:\n{r.stderr}"
    return r


def needed(binary):
    out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def test_readme_handler_example_links_with_pkg_config_alone(staged, tmp_path):
    src = tmp_path / "app.c"
    src.write_text(readme_handler_example())
    build(staged, str(src), str(tmp_path / "app"))
    assert "libidem.so.0" in needed(str(tmp_path / "app"))


def test_readme_handler_example_applies_and_exits_0_on_sigterm(staged, tmp_path, db, servers,
                                                              broker, request):
    """The README's C consumer, as written: it advances dunning once for a payment.failed (also
    when the event comes twice), and SIGTERM makes it finish and exit 0 (not 143)."""
    src = tmp_path / "app.c"
    src.write_text(readme_handler_example())
    app = str(tmp_path / "app")
    build(staged, str(src), app)
    queue = "dunning.q"  # the example's own names
    request.addfinalizer(lambda: [broker.delete_queue(q) for q in (queue, queue + ".dlq")])
    c = Daemon("readme_app", [app], db, servers, str(tmp_path),
               env={"LD_LIBRARY_PATH": staged.libdir})
    request.addfinalizer(lambda: finish_daemons([c], request))
    c.spawn()

    def consuming():
        if c.proc.poll() is not None:
            raise AssertionError(f"the README's consumer exited {c.proc.returncode}:\n{c.log()}")
        info = broker.queue_info(queue)
        return info is not None and info[1] >= 1

    wait_until(consuming, 20, 0.1, f"the README's consumer consuming from {queue}")
    sub, event = new_id(), new_id()
    body = {"invoice_id": new_id(), "subscription_id": sub, "amount_cents": 100,
            "currency": "EUR"}
    broker.publish_event("payment.failed", body, event_id=event)
    broker.publish_event("payment.failed", body, event_id=event)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'dunning'") == 1, 20, 0.1,
               "the README's handler applied the event")
    c.signal(signal.SIGTERM)
    assert c.wait_exit(15) == 0, c.log()
    assert db.dunning_step(sub) == 1
    assert broker.queue_info(queue)[0] == 0, "everything it took is acked"


@pytest.fixture(scope="module")
def example_bins(staged, tmp_path_factory):
    """The two examples, built against the installed tree with pkg-config alone (and checked to
    build without a warning under -Wall -Wextra)."""
    d = tmp_path_factory.mktemp("examples")
    bins = {}
    for name, src in (("emit_refund", "emitter/emit_refund.c"),
                      ("refund_consumer", "consumer/refund_consumer.c")):
        path = os.path.join(EXAMPLES, src)
        out = str(d / name)
        r = build(staged, path, out)
        assert r.stderr == "", f"{src}: compiler output:\n{r.stderr}"
        strict = staged.cc(path, out + ".strict", "-Wall -Wextra -Werror")
        assert strict.returncode == 0, f"{src} with -Wall -Wextra -Werror:\n{strict.stderr}"
        assert "libidem.so.0" in needed(out)
        bins[name] = out
    return bins


@pytest.fixture
def fresh_db(servers):
    """An empty database (no idem schema): the installed `idem migrate` prepares it."""
    name = "ex_" + uuid.uuid4().hex[:16]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    yield Db(servers.db_url(name))
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def apply_sql(db, path):
    with open(path) as f, db.connect() as conn, conn.cursor() as cur:
        cur.execute(f.read())


@pytest.fixture
def daemons(request):
    """Daemons a test starts; stopped after it, their logs printed if it failed."""
    started = []
    yield started
    finish_daemons(started, request)


def trace_of(request_key):
    """A W3C traceparent per request: 00-<32 hex trace id>-<16 hex span id>-01."""
    h = uuid.uuid5(uuid.NAMESPACE_URL, request_key).hex
    return f"00-{h}-{h[:16]}-01"


def test_examples_emit_relay_consume_exactly_once(staged, example_bins, fresh_db, servers, broker,
                                                 queue, tmp_path, daemons):
    db = fresh_db
    env = staged.run_env()
    env.pop("IDEM_SQL_DIR", None)  # the installed binary finds share/idem/sql by itself
    env.pop("IDEM_FAULT", None)
    env.update(IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url)

    def installed_idem(*args):
        return subprocess.run([staged.bin, *args], capture_output=True, text=True, env=env,
                              timeout=60, stdin=subprocess.DEVNULL)

    r = installed_idem("migrate")
    assert r.returncode == 0, r.stderr
    for sql in sorted(f for f in os.listdir(os.path.join(REPO, "sql")) if f.endswith(".sql")):
        assert f"applied {sql}" in r.stdout, r.stdout
    apply_sql(db, os.path.join(EXAMPLES, "emitter", "schema.sql"))
    apply_sql(db, os.path.join(EXAMPLES, "consumer", "schema.sql"))

    def consumer(fault=None):
        c = Daemon("refund_consumer", [example_bins["refund_consumer"], queue], db, servers,
                   str(tmp_path), fault=fault, env={"LD_LIBRARY_PATH": staged.libdir})
        daemons.append(c)
        c.spawn()

        def consuming():
            if c.proc.poll() is not None:
                raise AssertionError(f"refund_consumer exited {c.proc.returncode}:\n{c.log()}")
            info = broker.queue_info(queue)
            return info is not None and info[1] >= 1

        wait_until(consuming, 20, 0.1, f"refund_consumer consuming from {queue}")
        return c

    # 1. The consumer declares and binds its queue (refund.issued, its one handler); it is
    #    to crash once between COMMIT and ack.
    first = consumer(fault="consumer.after_commit")

    # 2. Three refunds through the emitter, plus a replay of the first request.
    sub_a, sub_b = new_id(), new_id()
    requests = [(sub_a, "1250", "USD", "ticket-1"), (sub_a, "700", "USD", "ticket-2"),
                (sub_b, "990", "EUR", "ticket-3"), (sub_a, "1250", "USD", "ticket-1")]
    ids = []
    for req in requests:
        # the request's trace context rides along as the header traceparent, emit to handler
        r = subprocess.run([example_bins["emit_refund"], *req], capture_output=True,
                           text=True, env={**env, "TRACEPARENT": trace_of(req[3])}, timeout=30)
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip())
    assert ids[3] == ids[0], "a replayed request must collapse into the same event"
    assert len(set(ids)) == 3
    assert db.count("refunds") == 3
    outbox = dict(db.query("SELECT event_id::text, status FROM idem.event_outbox "
                           "WHERE event_type = 'refund.issued'"))
    assert sorted(outbox) == sorted(set(ids))

    # 3. The installed relay publishes them.
    r = installed_idem("relay", "--once")
    assert r.returncode == 0, r.stderr
    assert db.count("idem.event_outbox", "status = 'sent'") == 3

    # 4. The consumer commits its first batch and is killed before acking it.
    assert first.wait_exit(30) == -signal.SIGKILL, first.log()
    committed = db.count("idem.consumed_events", "consumer = 'refunds'")
    assert committed >= 1

    # 5. Restarted, it gets the unacked deliveries again, and a copy of the first event.
    second = consumer()
    body = dict(zip(("refund_id", "subscription_id", "amount_cents", "currency"),
                    db.query("SELECT refund_id::text, subscription_id::text, amount_cents, "
                             "currency FROM refunds WHERE request_key = 'ticket-1'")[0]))
    broker.publish_event("refund.issued", body, event_id=ids[0])
    # a last refund, published after everything else: once it is applied, the consumer has
    # handled every delivery before it (one consumer, deliveries in queue order)
    sentinel_refund, sentinel_event = new_id(), new_id()
    broker.publish_event("refund.issued", {"refund_id": sentinel_refund,
                                           "subscription_id": sub_b, "amount_cents": 10,
                                           "currency": "EUR"}, event_id=sentinel_event)
    wait_until(lambda: db.count("refund_credits", "refund_id = %s", sentinel_refund) == 1,
               20, 0.1, "the last refund applied")

    # 6. SIGTERM: finish, ack, exit 0. Nothing is left in the queue (everything it took was
    #    acked) and nothing was dead-lettered.
    second.signal(signal.SIGTERM)
    assert second.wait_exit(15) == 0, second.log()
    assert broker.queue_info(queue)[0] == 0
    assert broker.queue_info(queue + ".dlq")[0] == 0

    # 7. Every effect exactly once.
    assert sorted(r[0] for r in db.query("SELECT event_id::text FROM refund_credits")) == \
        sorted(set(ids) | {sentinel_event})
    assert sorted(r[0] for r in db.query(
        "SELECT event_id::text FROM idem.consumed_events WHERE consumer = 'refunds'")) == \
        sorted(set(ids) | {sentinel_event})
    traces = dict(db.query("SELECT event_id::text, traceparent FROM refund_credits"))
    for req, eid in zip(requests[:3], ids[:3]):
        assert traces[eid] == trace_of(req[3]), (req, traces)
    assert traces[sentinel_event] is None  # published without one
    balances = {(s, c): b for s, c, b in db.query(
        "SELECT subscription_id::text, currency, balance_cents FROM credit_balances")}
    assert balances == {(sub_a, "USD"): 1950, (sub_b, "EUR"): 1000}
