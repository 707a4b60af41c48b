"""TLS to RabbitMQ, against a private broker with an amqps listener and a private CA
(scripts/services.sh --tls; --mtls for the client-certificate class).

- amqps:// with ?cacertfile=CA works end to end: a consumer applies an event, a relay publishes
  one, and the connect log lines say tls=on (a plain amqp:// one says tls=off). Without it,
  credentials and billing events would cross the network in clear, or "TLS" would be a label.
- Verification fails closed, each with one clear line naming the server and exit 1 from
  `idem relay --once`: a host name the certificate does not list (the servers reached through a
  forwarder on 127.0.0.2), a certificate signed by a CA the client was not given (system CAs
  only), server_name_indication naming another host. Without it a man in the middle with any
  certificate would read and forge events.
- server_name_indication= verifies the certificate against that name (not the dialed host);
  verify=verify_none connects (documented as insecure).
- Under --mtls a client without certfile/keyfile is refused with one line; with them it works.
- Daemons treat a TLS failure as temporary: they log it, retry with backoff, and stay up (exit 0
  on SIGTERM), like any unreachable server; they must not exit and leave events unprocessed.
- The contract: every connect log line says tls=on or tls=off, also the info-level lines of the
  daemons (not only the debug line of the adapter).
"""

import re
import uuid
import signal

import pytest

from conftest import IDEM, Consumer, finish_daemons, new_id, payload, run_idem, wait_until
from relay_helpers import declare_consumer_queue, emit, read_queue
from tls_helpers import (Forwarder, connect_lines, one_error_line, start_tls_instance,
                         tls_database)
from idem_harness import Daemon


@pytest.fixture
def tls(tls_servers, tls_db):
    """(TlsServers, Db of a fresh migrated database on the TLS instance)."""
    return tls_servers, tls_database(tls_servers, tls_db)


@pytest.fixture
def daemons(tmp_path, request):
    """Factory for idem daemons against the TLS instance; all stopped after the test (their logs
    printed if it failed)."""
    made = []

    def consumer(t, db, queue, amqp_url, args=(), name="billing", pg_url=None, debug=True):
        c = Consumer(name, queue, db, t.servers(), t.broker, str(tmp_path),
                     [*(["--log-level", "debug"] if debug else []), *args],
                     env={"IDEM_AMQP_URL": amqp_url, **({"IDEM_PG_URL": pg_url} if pg_url else {})})
        made.append(c)
        return c

    def relay(t, db, amqp_url, args=(), name="relay", pg_url=None):
        d = Daemon(name, [IDEM, "relay", *args], str(tmp_path), pg_url or db.url, amqp_url)
        made.append(d)
        return d.spawn()

    yield consumer, relay
    finish_daemons(made, request)


def relay_once(db, amqp_url, *args, debug=True):
    """`idem relay --once` (debug logging unless debug=False, as for checking a failure's one
    line)."""
    level = ["--log-level", "debug"] if debug else []
    return run_idem("relay", "--once", *level, *args, pg_url=db.url, amqp_url=amqp_url,
                    timeout=60)


def emit_one(db, event_type="payment.failed"):
    body = payload()
    return emit(db, event_type, body["subscription_id"], "k-" + new_id(), body), body


def pending_untouched(db, eid):
    """The row was neither published nor charged an attempt."""
    status, attempts = db.query("SELECT status, attempts FROM idem.event_outbox WHERE event_id = %s",
                                eid)[0]
    return status == "pending" and attempts == 0


def assert_verification_failure(r, server):
    """idem relay --once refused the server's certificate: exit 1, one line naming the server,
    saying TLS was on and that verification failed."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    line = one_error_line(r, "relay")
    assert line.startswith(f"idem relay: cannot connect to RabbitMQ at {server}: "), line
    assert "tls=on" in line, line
    assert re.search(r"verif|certificate", line, re.I), line
    return line


# ----------------------------------------------------------------------------- amqps works


def test_amqps_with_the_ca_consumes_and_publishes(tls, daemons, tls_queues):
    t, db = tls
    consumer, _ = daemons
    url = t.amqps_url()
    q = tls_queues.new()
    c = consumer(t, db, q, url).start()
    sub = new_id()
    t.broker.publish_event("payment.failed", payload(subscription_id=sub))
    wait_until(lambda: db.dunning_step(sub) == 1, 15, 0.1, "the event applied over amqps")
    lines = connect_lines(c.log())
    assert lines and all("tls=on" in line for line in lines if "tls=" in line), lines
    assert any("tls=on" in line for line in lines), lines
    assert c.stop() == 0

    # the relay publishes over amqps too
    q2 = tls_queues.new()
    declare_consumer_queue(t.broker, q2, ["invoice.paid"])
    eid, _ = emit_one(db, "invoice.paid")
    r = relay_once(db, url)
    assert r.returncode == 0, r.stderr
    assert "published 1," in r.stdout
    msgs = read_queue(t.broker, q2, expect=1, timeout=10)
    assert [m.event_id for m in msgs] == [eid]
    assert any("tls=on" in line for line in connect_lines(r.stderr)), r.stderr


def test_plain_amqp_says_tls_off(tls):
    t, db = tls
    r = relay_once(db, t.amqp_url())
    assert r.returncode == 0, r.stderr
    lines = [line for line in connect_lines(r.stderr) if "tls=" in line]
    assert lines and all("tls=off" in line for line in lines), r.stderr


def test_every_connect_line_says_tls(tls, daemons, tls_queues):
    """At the default log level too: the daemons' own "connected to RabbitMQ" lines."""
    t, db = tls
    consumer, relay = daemons
    c = consumer(t, db, tls_queues.new(), t.amqps_url(), debug=False).start()
    r = relay(t, db, t.amqps_url())
    wait_until(lambda: connect_lines(r.log()), 15, 0.1, "the relay connected to RabbitMQ")
    missing = []
    for who, log in (("consumer", c.log()), ("relay", r.log())):
        lines = connect_lines(log)
        assert lines, (who, log)
        missing += [f"{who}: {line}" for line in lines if "tls=on" not in line]
    assert not missing, "connect lines without tls=on:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------- fails closed


def test_wrong_host_name_fails_closed(tls):
    """The certificate names localhost and 127.0.0.1; the broker reached as 127.0.0.2 is
    refused before any credential or event crosses."""
    t, db = tls
    eid, _ = emit_one(db)
    with Forwarder(t.amqps_port) as fwd:
        r = relay_once(db, t.amqps_url(host=fwd.host, port=fwd.port), debug=False)
    line = assert_verification_failure(r, f"{fwd.host}:{fwd.port}")
    assert "guest" not in line
    assert pending_untouched(db, eid)


def test_ca_not_given_fails_closed(tls):
    """Without cacertfile the system CAs verify, and they do not know the private CA."""
    t, db = tls
    eid, _ = emit_one(db)
    r = relay_once(db, t.amqps_url(cacert=False), debug=False)
    assert_verification_failure(r, f"127.0.0.1:{t.amqps_port}")
    assert pending_untouched(db, eid)


def test_server_name_indication_is_the_name_verified(tls, tls_queues):
    t, db = tls
    # dialed by a name the certificate lacks, verified against one it has: accepted
    q = tls_queues.new()
    declare_consumer_queue(t.broker, q, ["payment.failed"])
    eid, _ = emit_one(db)
    with Forwarder(t.amqps_port) as fwd:
        r = relay_once(db, t.amqps_url(host=fwd.host, port=fwd.port,
                                       server_name_indication="localhost"))
    assert r.returncode == 0, r.stderr
    assert [m.event_id for m in read_queue(t.broker, q, expect=1, timeout=10)] == [eid]
    # dialed by a name the certificate has, verified against one it lacks: refused
    eid2, _ = emit_one(db)
    r = relay_once(db, t.amqps_url(server_name_indication="wrong.invalid"), debug=False)
    assert_verification_failure(r, f"127.0.0.1:{t.amqps_port}")
    assert pending_untouched(db, eid2)


def test_verify_none_connects(tls, tls_queues):
    """verify=verify_none (documented as insecure): no CA, a name the certificate lacks, and
    still connected, over TLS."""
    t, db = tls
    q = tls_queues.new()
    declare_consumer_queue(t.broker, q, ["payment.failed"])
    eid, _ = emit_one(db)
    with Forwarder(t.amqps_port) as fwd:
        r = relay_once(db, t.amqps_url(host=fwd.host, port=fwd.port, cacert=False,
                                       verify="verify_none"))
    assert r.returncode == 0, r.stderr
    assert any("tls=on" in line for line in connect_lines(r.stderr)), r.stderr
    # said once, at warn level: the broker is not authenticated
    warnings = [line for line in r.stderr.splitlines() if "without peer verification" in line]
    assert len(warnings) == 1 and " warn " in warnings[0], r.stderr
    assert [m.event_id for m in read_queue(t.broker, q, expect=1, timeout=10)] == [eid]


def test_daemons_retry_a_tls_failure(tls, daemons, tls_queues):
    """A consumer and a relay that cannot verify the broker log it, retry with backoff and stay
    up; SIGTERM stops them with exit 0."""
    t, db = tls
    consumer, relay = daemons
    bad = t.amqps_url(cacert=False)
    c = consumer(t, db, tls_queues.new(), bad)
    c.start(wait_ready=False)
    r = relay(t, db, bad, args=["--log-level", "debug"])
    failure = re.compile(r"cannot connect to RabbitMQ at 127\.0\.0\.1:%d: .*verif.*tls=on"
                         % t.amqps_port, re.I)

    def attempts(d):
        return len([line for line in d.log().splitlines() if failure.search(line)])

    # the first failure at warn level, the repeats at debug (backoff from 250 ms)
    wait_until(lambda: attempts(c) >= 3 and attempts(r) >= 3, 20, 0.2,
               lambda: f"3 failed attempts each (consumer {attempts(c)}, relay {attempts(r)})")
    assert c.running() and r.running()
    assert any(" warn " in line and failure.search(line) for line in c.log().splitlines())
    for d in (c, r):
        d.signal(signal.SIGTERM)
        assert d.wait_exit(15) == 0, d.log()[-2000:]


# ----------------------------------------------------------------------------- client certificates


@pytest.mark.cluster
class TestClientCertificate:
    """A broker that requires a client certificate (--mtls): another instance (~15 s)."""

    @pytest.fixture(scope="class")
    def mtls(self):
        with start_tls_instance("--mtls") as t:
            yield t

    @pytest.fixture
    def mdb(self, mtls):
        name = "t_" + uuid.uuid4().hex[:16]
        mtls.admin(f'CREATE DATABASE "{name}" TEMPLATE "{mtls.template}"')
        yield tls_database(mtls, name)
        mtls.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def test_without_a_client_certificate_one_line(self, mtls, mdb):
        eid, _ = emit_one(mdb)
        r = relay_once(mdb, mtls.amqps_url(), debug=False)
        assert r.returncode == 1, (r.stdout, r.stderr)
        line = one_error_line(r, "relay")
        assert line.startswith(f"idem relay: cannot connect to RabbitMQ at 127.0.0.1:"
                               f"{mtls.amqps_port}: "), line
        assert "tls=on" in line, line
        assert pending_untouched(mdb, eid)

    def test_without_a_client_certificate_the_line_says_so(self, mtls, mdb):
        """The operator must learn that a certificate is missing, not "a SSL error occurred"."""
        r = relay_once(mdb, mtls.amqps_url(), debug=False)
        line = one_error_line(r, "relay")
        assert re.search(r"certificate", line, re.I), line

    def test_with_the_client_certificate_it_works(self, mtls, mdb):
        q = "it.mtls." + new_id()[:8]
        declare_consumer_queue(mtls.broker, q, ["payment.failed"])
        try:
            eid, _ = emit_one(mdb)
            r = relay_once(mdb, mtls.amqps_url(client_cert=True))
            assert r.returncode == 0, r.stderr
            assert [m.event_id for m in read_queue(mtls.broker, q, expect=1, timeout=10)] == [eid]
            assert any("tls=on" in line for line in connect_lines(r.stderr)), r.stderr
        finally:
            mtls.broker.delete_queue(q)
            mtls.broker.delete_queue(q + ".dlq")
