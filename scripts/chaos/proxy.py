"""A TCP proxy between idem's daemons and RabbitMQ that can freeze a link.

One Listener per daemon (its own loopback port), so a fault can name the daemon whose link it
freezes. Each accepted connection is paired with a fresh connection to the broker and pumped
both ways by two threads. freeze() stops forwarding in both directions on the connections open
at that moment, without closing any socket: bytes wait in the kernel buffers and the peers see
a silent link, as behind a stalled NAT or a partitioned switch. Then resume() forwards again
(what waited is delivered) or drop() resets both sockets. Connections made during a freeze are
not frozen (a daemon that notices the silence and reconnects gets a working link), unless the
listener holds new links (hold(True): they are accepted and frozen at once).

freeze(keepalive=S) makes the link half-open: nothing is forwarded either way, but the proxy
sends the broker an AMQP heartbeat frame of its own every S seconds (between the client's
frames), so the daemon gives up on the silent link and reconnects while the broker still
holds the old connection, its consumers and its unacknowledged deliveries, until drop().
"""

import contextlib
import select
import socket
import struct
import threading

HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"  # type 8, channel 0, size 0, frame-end


class FrameTracker:
    """Where a client's byte stream stands in AMQP 0-9-1 framing: the 8-byte protocol header,
    then frames (type 1 byte, channel 2, size 4, payload, frame-end 1)."""

    def __init__(self):
        self.proto_left = 8
        self.head = b""  # the current frame's header bytes read so far (7 in all)
        self.body_left = 0  # payload and frame-end bytes still to come

    def feed(self, data):
        i, n = 0, len(data)
        while i < n:
            if self.proto_left:
                k = min(self.proto_left, n - i)
                self.proto_left -= k
            elif self.body_left:
                k = min(self.body_left, n - i)
                self.body_left -= k
            else:
                k = min(7 - len(self.head), n - i)
                self.head += data[i:i + k]
                if len(self.head) == 7:
                    self.body_left = struct.unpack(">I", self.head[3:7])[0] + 1
                    self.head = b""
            i += k

    def to_boundary(self):
        """Bytes that may be read without passing the next frame boundary; 0 at a boundary."""
        if self.proto_left:
            return self.proto_left
        if self.body_left:
            return self.body_left
        return 7 - len(self.head) if self.head else 0


class Link:
    """One client connection and its upstream connection to the broker."""

    def __init__(self, client, upstream):
        self.client = client
        self.upstream = upstream
        self.running = threading.Event()  # set: forwarding; clear: frozen
        self.running.set()
        self.closed = threading.Event()
        self.keepalive = None  # seconds between forged heartbeats while frozen, or None
        self.up_lock = threading.Lock()  # one writer to upstream at a time (pump, heartbeats)
        self.tracker = FrameTracker()  # of the client -> broker stream
        self.heartbeats_sent = 0

    def pump(self, src, dst):
        to_broker = dst is self.upstream
        try:
            while not self.closed.is_set():
                limit = 65536
                if not self.running.is_set():
                    # Frozen. Towards the broker a frame that is half forwarded is finished
                    # first, so that forged heartbeats land between frames.
                    limit = self.tracker.to_boundary() if to_broker and self.keepalive else 0
                    if not limit:
                        self.running.wait(0.2)
                        continue
                r, _, _ = select.select([src], [], [], 0.2)
                if not r or (not self.running.is_set() and not self.keepalive):
                    continue
                data = src.recv(limit)
                if not data:
                    break
                if to_broker:
                    with self.up_lock:
                        dst.sendall(data)
                        self.tracker.feed(data)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        self.close()

    def beat(self):
        """While frozen with keepalive: heartbeats to the broker on the client's behalf."""
        while not self.closed.is_set() and not self.running.is_set() and self.keepalive:
            with self.up_lock:
                if self.tracker.to_boundary() == 0 and not self.running.is_set():
                    with contextlib.suppress(OSError):
                        self.upstream.sendall(HEARTBEAT_FRAME)
                        self.heartbeats_sent += 1
            self.closed.wait(self.keepalive)

    def freeze(self, keepalive=None):
        self.keepalive = keepalive
        self.running.clear()
        if keepalive:
            threading.Thread(target=self.beat, daemon=True, name="proxy-keepalive").start()

    def resume(self):
        self.keepalive = None
        self.running.set()

    def close(self, reset=False):
        if self.closed.is_set():
            return
        self.closed.set()
        self.running.set()
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                if reset:  # RST instead of FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class Listener:
    """Accepts on 127.0.0.1:port (0 = any free port) and forwards to upstream (host, port)."""

    def __init__(self, name, upstream, port=0):
        self.name = name
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.links = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.holding = False  # new links start frozen
        self.accepted = 0
        self.refused = 0  # clients closed at once because the broker could not be reached
        self.thread = threading.Thread(target=self._accept, name=f"proxy-{name}", daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stopped.is_set():
            try:
                r, _, _ = select.select([self.sock], [], [], 0.2)
                if not r:
                    continue
                client, _ = self.sock.accept()
            except OSError:
                if self.stopped.is_set():
                    return
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=3)
                upstream.settimeout(None)
            except OSError:
                self.refused += 1
                with contextlib.suppress(OSError):
                    client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = Link(client, upstream)
            with self.lock:
                if self.holding:
                    link.freeze()
                self.links = [ln for ln in self.links if not ln.closed.is_set()]
                self.links.append(link)
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=link.pump, args=(src, dst), daemon=True,
                                 name=f"proxy-{self.name}-pump").start()

    def open_links(self):
        with self.lock:
            return [ln for ln in self.links if not ln.closed.is_set()]

    def hold(self, on):
        """While on, links accepted are frozen at once (and returned by open_links)."""
        with self.lock:
            self.holding = on

    def freeze(self, keepalive=None):
        """Freezes the open links; returns them (for resume or drop), [] if none is open.
        keepalive: seconds between the heartbeats forged towards the broker (half-open)."""
        links = self.open_links()
        for ln in links:
            ln.freeze(keepalive)
        return links

    @staticmethod
    def resume(links):
        for ln in links:
            ln.resume()

    @staticmethod
    def drop(links):
        for ln in links:
            ln.close(reset=True)

    def close(self):
        self.stopped.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        self.thread.join(2)
        for ln in self.open_links():
            ln.close()
