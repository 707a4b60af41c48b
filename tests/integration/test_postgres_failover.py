"""A PostgreSQL failover (primary lost, synchronous standby promoted) under load: the relay and
the consumer, given libpq's multi-host URL with target_session_attrs=read-write, carry on against
the new primary by themselves, and of the events whose emitting transaction got a COMMIT
acknowledgement none is lost and none is applied twice; each subscription's effects stay in emit
order.

The emitter, like a careful application, retries a transaction whose COMMIT was not acknowledged
with the same dedup keys (idem_emit collapses the replay when the first COMMIT did land), so every
event ends acknowledged. The time from the promotion to the first effect is printed.

Without the consumer acking only after its COMMIT, an event in flight at the crash would be acked
and lost; without the ledger, a batch committed on the standby but not acknowledged would be
applied again when redelivered; without the daemons passing the conninfo through to libpq and
reconnecting by themselves, they would stay on the dead primary (or on the read-only standby)."""

import time

import pytest

from conftest import Db, finish_daemons, run_idem, wait_until
from group_helpers import (Emitter, Endpoints, GroupConsumer, audit, install_effect_log,
                           plan_billing)
from ha_helpers import instance_fixture
from relay_helpers import RelayDaemon, status_counts

pytestmark = pytest.mark.cluster

ha = instance_fixture("--pg-standby")

SUBS = 40
PER_SUB = 10
RATE = 200.0  # events/s: 400 events in about 2 s plus the failover
OUTAGE = 2.0  # seconds without a read-write server before the promotion


def test_postgres_failover_under_load(ha, broker, tmp_path, request):
    assert ha.replication() == [("idem_pg2", "streaming", "sync")]
    url = ha.pg_url_ha
    assert "target_session_attrs=read-write" in url
    r = run_idem("migrate", "--billing", pg_url=url, amqp_url=ha.amqp_url(1))
    assert r.returncode == 0, r.stderr
    db = Db(url)
    install_effect_log(db)
    plan, order = plan_billing(SUBS, PER_SUB, seed=23)
    q = "it.pgfailover"
    ep = Endpoints(ha.amqp_url(1))
    daemons = []
    request.addfinalizer(lambda: finish_daemons(daemons, request))

    consumer = GroupConsumer("billing", q, db, ep, broker, str(tmp_path), (), None, None, True)
    daemons.append(consumer)
    consumer.start()
    relay = RelayDaemon(db, ep, str(tmp_path), ["--poll-interval", "50ms"], name="relay")
    daemons.append(relay)
    relay.start(wait_ready=True)

    emitter = Emitter(url, order, rate=RATE, per_tx=1, retry=True, connect_timeout=2)
    emitter.start()
    wait_until(lambda: emitter.progress >= len(order) // 3, 30, 0.05, "a third of the load")
    t_crash = time.time()
    ha.pg_stop(immediate=True)
    t_down = time.time()
    # a failover takes a while: meanwhile only the read-only standby answers
    wait_until(lambda: "read-only" in consumer.log() or "read-only" in relay.log(), 30, 0.05,
               "a daemon turned away by the read-only standby")
    time.sleep(OUTAGE)
    ha.pg_promote()
    t_promoted = time.time()
    assert ha.primary == 2

    emitter.finish(timeout=120)
    total = len(order) + sum(e.type == "invoice.paid" for e in order)
    wait_until(lambda: db.count("idem.consumed_events", "consumer = 'billing'") >= total, 120, 0.2,
               lambda: f"{total} ledger rows (have "
               f"{db.count('idem.consumed_events', 'consumer = %s', 'billing')}; outbox "
               f"{status_counts(db)}); last lines of the daemons' logs:\n"
               + "\n".join(d.log().splitlines()[-1][:400] for d in daemons))
    t_drained = time.time()
    for d in daemons:
        assert d.running(), f"{d.name} exited:\n{d.log()[-3000:]}"
        log = d.log()
        assert log.count("connected to PostgreSQL") > log[:log.find("connected to RabbitMQ")
                                                           ].count("connected to PostgreSQL"), \
            f"{d.name} logged no reconnect to PostgreSQL"

    acked = set(emitter.acked)
    assert acked == {e.id for e in order}, "the emitter did not get every event acknowledged"
    audit(db.query, plan, only=acked)
    assert db.count("idem.event_outbox", "status <> 'sent'") == 0
    assert broker_depth(ha, q + ".dlq") == 0

    first_after = db.scalar("SELECT extract(epoch FROM min(at))::float8 FROM it_effects "
                            "WHERE at > to_timestamp(%s)", t_promoted)
    print(f"\nprimary stopped (immediate) in {t_down - t_crash:.1f} s, standby promoted "
          f"{t_promoted - t_down:.1f} s later; first effect {first_after - t_promoted:.2f} s "
          f"after the promotion ({first_after - t_crash:.1f} s after the crash); drained "
          f"{t_drained - emitter.done_at:.1f} s after the load ended; emitter: "
          f"{len(emitter.failures)} failed tries, {len(emitter.in_doubt)} COMMITs in doubt, "
          f"all {len(acked)} events acknowledged and applied once in order")


def broker_depth(inst, queue):
    import pika
    params = pika.URLParameters(inst.amqp_url(1))
    params.connection_attempts = 1
    conn = pika.BlockingConnection(params)
    try:
        return conn.channel().queue_declare(queue=queue, passive=True).method.message_count
    finally:
        conn.close()
