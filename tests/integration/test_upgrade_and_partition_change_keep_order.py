"""The README's procedure for upgrading from an older idem's topology, and for changing
--partitions, keeps each subscription's order with events in flight.

The procedure (README "Upgrading and changing --partitions"): stop the relay (events wait in the
outbox); let the old consumers drain their queues (nothing ready, nothing unacknowledged); stop
them; delete the old queues (`rabbitmqctl delete_queue`); `idem migrate`; start the new
consumers; start the relay. Each test emits a billing load through idem_emit all along (paced,
in a thread), runs the procedure in the middle of it, and audits the end (group_helpers): every
event applied once, each subscription's effects in emit order.

- Upgrade: the older idem is built from OLD_COMMIT (the last one with the consistent-hash ring
  and a plain queue without single active consumer). Its plain queue, and its partitioned group
  (QUEUE.hash), are refused by this idem while they are in place: exit 1, one line naming the
  README section; after the procedure the new topology runs (the unused QUEUE.hash is deleted by
  the new consumer).
- P change: a group of P processes is switched to P' (plain to partitioned, and fewer
  partitions); a process with P' exits 1, one line, before the old queues are deleted.

Without the refusals a redeclared topology would be used silently (two routings feeding one
subscription's events to different queues); without the procedure's drain the new consumers
would apply later events before the old queues' earlier ones."""

import os
import subprocess
import uuid

import pytest

from conftest import IDEM, REPO, Db, admin_exec, finish_daemons, wait_until
from group_helpers import (Emitter, audit, group_consumers, group_queue, install_effect_log,
                           partitions, plan_billing)
from relay_helpers import RelayDaemon, relay_daemons

# Each procedure drains a group and declares another with events in flight: 30-60 s a case.
pytestmark = pytest.mark.slow

__all__ = ["group_consumers", "group_queue", "relay_daemons"]

OLD_COMMIT = "b6262ec"
SUBS = 40
PER_SUB = 30
RATE = 150.0  # events/s: 1,200 events in about 8 s


@pytest.fixture(scope="session")
def old_idem():
    """build/old-OLD_COMMIT/build/idem: the older idem, built once from git."""
    tree = os.path.join(REPO, "build", f"old-{OLD_COMMIT}")
    binary = os.path.join(tree, "build", "idem")
    if not os.path.exists(binary):
        os.makedirs(tree, exist_ok=True)
        archive = subprocess.run(["git", "-C", REPO, "archive", OLD_COMMIT],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        r = subprocess.run(["make", "-C", tree, "-j2", "build/idem"], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    return tree, binary


def queue_counts(servers, name):
    """(ready, unacked) of queue name, or None when it does not exist."""
    for line in servers.rmqctl("-q", "list_queues", "name", "messages_ready",
                               "messages_unacknowledged").splitlines():
        f = line.split("\t")
        if f[0] == name:
            return int(f[1]), int(f[2])
    return None


def exits_refused(db, servers, queue, *args, binary=IDEM):
    """Runs `idem consume` on queue; it must exit 1 with one line naming the README section."""
    e = dict(os.environ, IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url)
    e.pop("IDEM_FAULT", None)
    r = subprocess.run([binary, "consume", "--log-level", "warn", "--consumer", "billing",
                        "--queue", queue, *args], env=e, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 1, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("idem consume: "), r.stderr
    assert "Upgrading and changing --partitions" in lines[0], lines[0]
    return lines[0]


def procedure(db, servers, relay, old_procs, queues):
    """Stop the relay, drain, stop the old consumers, delete the old queues; returns the
    backlog the outbox held meanwhile."""
    assert relay.stop() == 0
    wait_until(lambda: all(queue_counts(servers, n) == (0, 0) for n in queues), 60, 0.2,
               lambda: f"old queues drained: {[queue_counts(servers, n) for n in queues]}")
    for p in old_procs:
        assert p.stop() == 0, p.log()[-3000:]
    return queues


def delete_queues(servers, queues):
    for n in queues:
        servers.rmqctl("delete_queue", n)


def finish(db, broker, plan, order, emitter, queues):
    emitter.finish()
    total = len(order) + sum(e.type == "invoice.paid" for e in order)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 120, 0.2,
               lambda: f"{total} ledger rows (have "
               f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')})")
    summary = audit(db.query, plan)
    assert summary["ledger_rows"] == total
    for n in queues:
        assert broker.queue_info(n)[0] == 0, n
    return summary


def old_relay(db, servers, tmp_path, binary):
    r = RelayDaemon(db, servers, str(tmp_path), ["--poll-interval", "50ms"], name="old-relay")
    r.argv[0] = binary
    return r.start(wait_ready=True)


def older_database(servers, tree, binary):
    """A new database migrated by the older idem itself (its objects in public, as it made
    them)."""
    name = "old_" + uuid.uuid4().hex[:16]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    odb = Db(servers.db_url(name))
    r = subprocess.run([binary, "migrate"], env=dict(os.environ, IDEM_PG_URL=odb.url,
                                                     IDEM_SQL_DIR=os.path.join(tree, "sql")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return name, odb


def with_search_path(url, path):
    """url (a libpq URI) whose sessions have search_path = path."""
    return url + ("&" if "?" in url else "?") + "options=-csearch_path%3D" + path.replace(",", "%2C")


@pytest.mark.parametrize("p_old", [1, 2])
def test_upgrade_from_an_older_idem_keeps_order(servers, broker, group_queue, group_consumers,
                                                old_idem, tmp_path, request, p_old):
    tree, binary = old_idem
    name, db = older_database(servers, tree, binary)
    made = []
    try:
        q = group_queue(f"upgrade{p_old}")
        install_effect_log(db, schema="public")
        plan, order = plan_billing(SUBS, PER_SUB, seed=40 + p_old)
        args = ["--partitions", str(p_old)] if p_old > 1 else []
        # the older idem's plain queue keeps order with one process only; its partitions had
        # single active consumers
        old = [group_consumers("billing", q, db, args, label=f"old{i}", start=False)
               for i in range(1 if p_old == 1 else 2)]
        for c in old:
            c.argv[0] = binary
            c.start()
        old_queues = partitions(q, p_old) if p_old > 1 else [q]
        relay = old_relay(db, servers, tmp_path, binary)
        made.append(relay)
        # the application calls idem_emit through its search_path: public's before the move,
        # idem's after it; a transaction that fails while migrate moves the objects is retried,
        # as an application retries any failed transaction
        emitter = Emitter(with_search_path(db.url, "idem,public"), order, rate=RATE, per_tx=5,
                          fn="idem_emit", retry=True)
        emitter.start()
        wait_until(lambda: db.count("public.consumed_events") >= 200, 60, 0.1,
                   "the old group applying")

        procedure(db, servers, relay, old, old_queues)
        r = subprocess.run([IDEM, "migrate", "--billing"], env=dict(os.environ, IDEM_PG_URL=db.url),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # the older topology is refused while it is in place
        line = exits_refused(db, servers, q, *args)
        assert (q + ".hash" if p_old > 1 else q) in line, line
        delete_queues(servers, old_queues)
        backlog = db.count("idem.event_outbox", "status <> 'sent'")
        new = [group_consumers("billing", q, db, args, label=f"new{i}") for i in range(2)]
        made.append(RelayDaemon(db, servers, str(tmp_path), ["--poll-interval", "50ms"],
                                name="new-relay").start(wait_ready=True))
        summary = finish(db, broker, plan, order, emitter, old_queues)
        xs = servers.rmqctl("-q", "list_exchanges", "name")
        assert q + ".hash" not in xs.split(), "the older idem's hash exchange is left"
        for c in new:
            assert c.running(), c.log()[-3000:]
        print(f"\nupgrade of P={p_old} with {backlog} events waiting in the outbox: "
              f"{summary['events']} events applied once in order")
    finally:
        finish_daemons(made, request)
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize("p_old, p_new", [(1, 3), (3, 2)])
def test_changing_partitions_keeps_order(db, servers, broker, group_queue, group_consumers,
                                         relay_daemons, p_old, p_new):
    q = group_queue(f"p{p_old}to{p_new}")
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=50 + p_old)
    args_old = ["--partitions", str(p_old)]
    args_new = ["--partitions", str(p_new)]
    old = [group_consumers("billing", q, db, args_old, label=f"old{i}") for i in range(2)]
    old_queues = partitions(q, p_old) if p_old > 1 else [q]
    relay = relay_daemons(["--poll-interval", "50ms"], wait_ready=True)
    emitter = Emitter(db.url, order, rate=RATE, per_tx=5)
    emitter.start()
    wait_until(lambda: db.count("idem.consumed_events") >= 200, 30, 0.1, "the old group applying")

    procedure(db, servers, relay, old, old_queues)
    exits_refused(db, servers, q, *args_new)
    delete_queues(servers, old_queues)
    new = [group_consumers("billing", q, db, args_new, label=f"new{i}") for i in range(2)]
    relay_daemons(["--poll-interval", "50ms"], wait_ready=True)
    new_queues = partitions(q, p_new) if p_new > 1 else [q]
    finish(db, broker, plan, order, emitter, new_queues)
    for c in new:
        assert c.running(), c.log()[-3000:]
