"""The relay keeps several batches in flight, and a broken broker link settles each on its own
confirms (README, "How it works": the next batch is claimed and published while earlier ones
wait for their confirms; contract: nothing is marked sent without the broker's confirm, and a
broken link keeps what the broker confirmed).

The relay reaches RabbitMQ through a proxy that can hold back what the broker sends. With the
broker's side held, batch A (10 events over 10 subscriptions) is published and queued, but its
confirms do not reach the relay. Batch B (10 events over 10 other subscriptions) is emitted: the
relay must claim and publish it while A still waits for its confirms. Then the proxy passes on
exactly the bytes the broker had sent before B was published (A's confirms) and breaks the link.

A's rows must be marked sent from those confirms, so they are never published again; B's rows
were unconfirmed when the link broke, so they stay pending with no attempt spent and go out
again after the reconnect (the broker then holds them twice, which the consumers' ledger absorbs).
"""

import contextlib
import select
import socket
import threading
import time
import urllib.parse

import pytest

from conftest import new_id, payload, wait_until
from relay_helpers import (declare_consumer_queue, emit_many, outbox, read_queue, relay_daemons,
                           status_counts)

__all__ = ["relay_daemons"]

TYPE = "payment.failed"
N = 10


class HoldingProxy:
    """A TCP proxy (threads) in front of host:port. Client-to-broker bytes always pass. After
    hold(), broker-to-client bytes are kept back in a buffer; release_and_cut(upto) passes on the
    first `upto` of them and then closes both sides of every connection (a broken link).
    Connections made afterwards are forwarded normally."""

    def __init__(self, host, port):
        self.upstream = (host, port)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.lsock.settimeout(0.2)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.conns = []  # [client, upstream, held bytearray or None, cut Event]
        self.closing = threading.Event()
        self.accepted = 0
        self.holding = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.closing.is_set():
            try:
                cli, _ = self.lsock.accept()
            except OSError:
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                cli.close()
                continue
            c = [cli, up, None, threading.Event()]
            with self.lock:
                self.conns.append(c)
                self.accepted += 1
            threading.Thread(target=self._pump, args=(cli, up, c, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, cli, c, True), daemon=True).start()

    def _pump(self, src, dst, c, from_broker):
        cut = c[3]
        while not self.closing.is_set() and not cut.is_set():
            try:
                r, _, _ = select.select([src], [], [], 0.05)
                if not r or cut.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    if from_broker and c[2] is not None:
                        c[2] += data
                        continue
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def url(self, amqp_url):
        u = urllib.parse.urlsplit(amqp_url)
        return urllib.parse.urlunsplit(
            u._replace(netloc=f"{u.username}:{u.password}@127.0.0.1:{self.port}"))

    def hold(self):
        """From now on the broker's bytes on every open connection are held back."""
        with self.lock:
            for c in self.conns:
                if c[2] is None:
                    c[2] = bytearray()
            return len(self.conns)

    def held(self):
        """How many bytes are held back on the open connections (one number per connection)."""
        with self.lock:
            return [len(c[2]) for c in self.conns if c[2] is not None and not c[3].is_set()]

    def release_and_cut(self, upto):
        """Passes on the first upto[i] held bytes of each held connection, then breaks it."""
        with self.lock:
            held = [c for c in self.conns if c[2] is not None and not c[3].is_set()]
            for c, n in zip(held, upto):
                with contextlib.suppress(OSError):
                    c[0].sendall(bytes(c[2][:n]))
                c[3].set()
                for s in (c[0], c[1]):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
            self.conns = [c for c in self.conns if c not in held]

    def close(self):
        self.closing.set()
        self.thread.join(2)
        with self.lock:
            for c in self.conns:
                c[3].set()
                for s in (c[0], c[1]):
                    with contextlib.suppress(OSError):
                        s.close()
        self.lsock.close()


@pytest.fixture
def proxy(servers):
    u = urllib.parse.urlsplit(servers.amqp_url)
    p = HoldingProxy(u.hostname, u.port)
    yield p
    p.close()


def emit_batch(db, tag):
    subs = [new_id() for _ in range(N)]
    return emit_many(db, [(TYPE, s, f"{tag}:{s}", payload(subscription_id=s)) for s in subs],
                     per_tx=N)


def test_link_breaks_with_two_batches_in_flight(db, servers, queue, broker, proxy,
                                                relay_daemons):
    declare_consumer_queue(broker, queue, [TYPE])
    relay = relay_daemons(["--batch", str(N)], start=False)
    relay.env["IDEM_AMQP_URL"] = proxy.url(servers.amqp_url)
    relay.start(wait_ready=True)
    assert proxy.accepted == 1

    assert proxy.hold() == 1
    a = emit_batch(db, "a")
    # A is published and queued; its confirms are held back by the proxy
    wait_until(lambda: broker.depth(queue) == N, 10, 0.05,
               lambda: f"batch A in the queue (depth {broker.depth(queue)})\n{relay.log()[-2000:]}")
    time.sleep(0.5)  # the broker writes A's confirms
    mark = proxy.held()
    assert len(mark) == 1 and mark[0] > 0, mark
    assert all(v["status"] == "pending" for v in outbox(db).values()), (
        "batch A was marked sent without its confirms")

    b = emit_batch(db, "b")
    wait_until(lambda: broker.depth(queue) == 2 * N, 10, 0.05,
               lambda: f"batch B claimed and published while A waits for its confirms (depth "
                       f"{broker.depth(queue)})\n{relay.log()[-3000:]}")
    time.sleep(0.3)
    proxy.release_and_cut(mark)

    wait_until(lambda: db.count("idem.event_outbox", "status = 'sent'") == 2 * N, 20, 0.1,
               lambda: f"{2 * N} rows sent (now {status_counts(db)})\n{relay.log()[-3000:]}")
    rows = outbox(db)
    assert all(rows[i]["attempts"] == 0 for i in a + b), "a broken link spends nothing"
    log = relay.log()
    assert "broker link failed" in log, log[-3000:]
    assert proxy.accepted >= 2, "the relay did not reconnect"

    got = [m.event_id for m in read_queue(broker, queue, expect=3 * N, timeout=10, idle=1.0)]
    assert sorted(got.count(i) for i in a) == [1] * N, (
        "batch A was confirmed before the link broke: it must be marked sent, not published "
        f"again\n{log[-3000:]}")
    assert sorted(got.count(i) for i in b) == [2] * N, (
        "batch B was unconfirmed when the link broke: it goes out again once")
    assert relay.running()
