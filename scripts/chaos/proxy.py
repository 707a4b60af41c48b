"""A TCP proxy between idem's daemons and RabbitMQ that can freeze a link.

One Listener per daemon (its own loopback port), so a fault can name the daemon whose link it
freezes. Each accepted connection is paired with a fresh connection to the broker and pumped
both ways by two threads. freeze() stops forwarding in both directions on the connections open
at that moment, without closing any socket: bytes wait in the kernel buffers and the peers see
a silent link, as behind a stalled NAT or a partitioned switch. Then resume() forwards again
(what waited is delivered) or drop() resets both sockets. Connections made during a freeze are
not frozen (a daemon that notices the silence and reconnects gets a working link).
"""

import contextlib
import select
import socket
import struct
import threading


class Link:
    """One client connection and its upstream connection to the broker."""

    def __init__(self, client, upstream):
        self.client = client
        self.upstream = upstream
        self.running = threading.Event()  # set: forwarding; clear: frozen
        self.running.set()
        self.closed = threading.Event()

    def pump(self, src, dst):
        try:
            while not self.closed.is_set():
                if not self.running.is_set():
                    self.running.wait(0.2)
                    continue
                r, _, _ = select.select([src], [], [], 0.2)
                if not r or not self.running.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        self.close()

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
                self.links = [ln for ln in self.links if not ln.closed.is_set()]
                self.links.append(link)
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=link.pump, args=(src, dst), daemon=True,
                                 name=f"proxy-{self.name}-pump").start()

    def open_links(self):
        with self.lock:
            return [ln for ln in self.links if not ln.closed.is_set()]

    def freeze(self):
        """Freezes the open links; returns them (for resume or drop), [] if none is open."""
        links = self.open_links()
        for ln in links:
            ln.running.clear()
        return links

    @staticmethod
    def resume(links):
        for ln in links:
            ln.running.set()

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
