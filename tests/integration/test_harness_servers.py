"""The harness's own servers, as HA and TLS tests use them (scripts/services.sh start options):
a 3-node RabbitMQ cluster with the consistent-hash plugin on every node, whose quorum queues get
a new leader when the leader's node stops; a PostgreSQL synchronous standby that takes over after
the primary dies; TLS listeners that verify against the private CA and fail for a wrong name or,
under --mtls, without a client certificate. Starts servers of its own (~40 s): marked `cluster`,
deselect with -m "not cluster"."""

import socket
import ssl

import pika
import psycopg2
import pytest

from conftest import wait_until
from ha_helpers import instance_fixture

pytestmark = pytest.mark.cluster

# Class-scoped: each instance stops when its class is done, so at most one runs at a time.
cluster = instance_fixture("--rmq-nodes", "3", scope="class")
ha_tls = instance_fixture("--pg-standby", "--tls", scope="class")
mtls = instance_fixture("--mtls", "--tls-wrong-name", "--no-hash-plugin", scope="class")


def channel_on(url):
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 5
    conn = pika.BlockingConnection(params)
    return conn, conn.channel()


def tls_context(inst, client_cert=False):
    ctx = ssl.create_default_context(cafile=inst.tls("ca"))
    if client_cert:
        ctx.load_cert_chain(inst.tls("client_cert"), inst.tls("client_key"))
    return ctx


def amqps_channel(inst, server_name, client_cert=False):
    """An AMQP channel over TLS to node 1, verifying the server certificate for server_name."""
    params = pika.ConnectionParameters(
        "127.0.0.1", int(inst.env["IDEM_AMQPS_PORT"]), connection_attempts=1, socket_timeout=5,
        ssl_options=pika.SSLOptions(tls_context(inst, client_cert), server_name))
    conn = pika.BlockingConnection(params)
    return conn, conn.channel()


def tls_handshake(port, ctx, server_name):
    """Completes a TLS handshake with 127.0.0.1:port verifying server_name; returns the peer's
    subjectAltName DNS entries."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=server_name) as s:
        return [v for k, v in s.getpeercert()["subjectAltName"] if k == "DNS"]


def pg_tls_connect(inst, host, user="postgres", sslmode="verify-full", client_cert=False):
    kw = dict(host=host, hostaddr="127.0.0.1", port=inst.pg_port(), user=user, dbname="idem",
              sslmode=sslmode, sslrootcert=inst.tls("ca"), connect_timeout=5)
    if client_cert:
        kw.update(sslcert=inst.tls("client_cert"), sslkey=inst.tls("client_key"))
    conn = psycopg2.connect(**kw)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            return cur.fetchone()[0]
    finally:
        conn.close()


class TestRabbitMQCluster:
    def test_three_running_nodes_each_with_the_hash_plugin(self, cluster):
        assert cluster.nodes == 3
        assert len(cluster.amqp_urls.split(",")) == 3
        for k in (1, 2, 3):
            assert cluster.running_nodes(node=k) == [1, 2, 3]
            conn, ch = channel_on(cluster.amqp_url(k))
            try:
                ch.exchange_declare(f"it.harness.hash{k}", "x-consistent-hash")
                ch.exchange_delete(f"it.harness.hash{k}")
            finally:
                conn.close()

    def test_quorum_leader_moves_when_its_node_stops(self, cluster):
        q = "it.harness.leader"
        conn, ch = channel_on(cluster.amqp_url(1))
        try:
            ch.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
            ch.confirm_delivery()
            ch.basic_publish("", q, b"kept", pika.BasicProperties(delivery_mode=2))
        finally:
            conn.close()
        leader = cluster.leader(q)
        assert leader in (1, 2, 3)
        cluster.rmq_stop(leader)
        try:
            assert len(cluster.running_nodes()) == 2
            new = wait_until(lambda: (lambda k: k if k != leader else None)(cluster.leader(q)),
                             30, 0.5, "a new leader")
            conn, ch = channel_on(cluster.amqp_url(new))
            try:
                method, _, body = ch.basic_get(q, auto_ack=True)
                assert body == b"kept"
            finally:
                conn.close()
        finally:
            cluster.rmq_start(leader)
        assert cluster.running_nodes() == [1, 2, 3]
        conn, ch = channel_on(cluster.amqp_url(leader))
        try:
            ch.queue_delete(q)
        finally:
            conn.close()


class TestStandbyAndTls:
    def test_tls_verifies_with_the_private_ca_and_fails_for_a_wrong_name(self, ha_tls):
        port = int(ha_tls.env["IDEM_AMQPS_PORT"])
        assert ha_tls.env["IDEM_TLS_SERVER_NAME"] == "localhost"
        for name in ("localhost", "127.0.0.1"):
            assert "localhost" in tls_handshake(port, tls_context(ha_tls), name)
        with pytest.raises(ssl.SSLCertVerificationError, match="[Hh]ostname mismatch"):
            tls_handshake(port, tls_context(ha_tls), "other.example")
        with pytest.raises(ssl.SSLCertVerificationError):
            tls_handshake(port, ssl.create_default_context(), "localhost")  # system CAs only
        conn, ch = amqps_channel(ha_tls, "127.0.0.1")
        try:
            ch.exchange_declare("it.harness.tls", "x-consistent-hash")
            ch.exchange_delete("it.harness.tls")
        finally:
            conn.close()

        assert pg_tls_connect(ha_tls, "127.0.0.1") is True
        assert pg_tls_connect(ha_tls, "localhost") is True
        with pytest.raises(psycopg2.OperationalError, match="does not match host name"):
            pg_tls_connect(ha_tls, "wrong.example")
        user = ha_tls.env["IDEM_TLS_CLIENT_USER"]
        with pytest.raises(psycopg2.OperationalError, match="requires a valid client certificate"):
            pg_tls_connect(ha_tls, "127.0.0.1", user=user)
        with pytest.raises(psycopg2.OperationalError, match="no encryption"):
            pg_tls_connect(ha_tls, "127.0.0.1", user=user, sslmode="disable")
        assert pg_tls_connect(ha_tls, "127.0.0.1", user=user, client_cert=True) is True

    def test_synchronous_standby_takes_over_after_the_primary_dies(self, ha_tls):
        assert ha_tls.replication() == [("idem_pg2", "streaming", "sync")]
        with psycopg2.connect(ha_tls.pg_url_ha, connect_timeout=5) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE harness_failover (n int)")
            cur.execute("INSERT INTO harness_failover VALUES (1)")
        ha_tls.pg_stop(immediate=True)
        with pytest.raises(psycopg2.OperationalError, match="read-only"):
            psycopg2.connect(ha_tls.pg_url_ha, connect_timeout=5).close()
        ha_tls.pg_promote()
        assert ha_tls.primary == 2
        with psycopg2.connect(ha_tls.pg_url_ha, connect_timeout=5) as conn, conn.cursor() as cur:
            cur.execute("INSERT INTO harness_failover VALUES (2)")
            cur.execute("SELECT array_agg(n ORDER BY n), inet_server_port() FROM harness_failover")
            assert cur.fetchone() == ([1, 2], ha_tls.pg_port(2))
        ha_tls.pg_rejoin()
        assert ha_tls.replication() == [("idem_pg1", "streaming", "sync")]


class TestMutualTlsWrongNameNoPlugin:
    def test_client_certificate_required_and_wrong_name_presented(self, mtls):
        name = mtls.env["IDEM_TLS_SERVER_NAME"]
        assert name == "wrong.invalid" and mtls.env["IDEM_TLS_MUTUAL"] == "1"
        with pytest.raises(ssl.SSLCertVerificationError, match="[Hh]ostname mismatch"):
            amqps_channel(mtls, "localhost", client_cert=True)
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            # TLS 1.3: the server refuses once the handshake is done
            amqps_channel(mtls, name, client_cert=False)
        conn, _ = amqps_channel(mtls, name, client_cert=True)
        conn.close()

        with pytest.raises(psycopg2.OperationalError, match="does not match host name"):
            pg_tls_connect(mtls, "127.0.0.1")
        assert pg_tls_connect(mtls, name) is True
        assert pg_tls_connect(mtls, "127.0.0.1", sslmode="verify-ca") is True

    def test_hash_exchange_type_unknown_without_the_plugin(self, mtls):
        assert mtls.env["IDEM_RMQ_HASH_PLUGIN"] == "0"
        conn, ch = channel_on(mtls.amqp_url(1))
        try:
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker,
                               match="unknown exchange type 'x-consistent-hash'"):
                ch.exchange_declare("it.harness.nohash", "x-consistent-hash")
        finally:
            if conn.is_open:
                conn.close()
