"""Helpers for the operations tests (retain, status, failed, replay, metrics, CLI errors).

Builds on conftest.py (servers, db, broker, consumers, run_idem); adds row factories for the
outbox and the ledger, a relay daemon with metrics, and a Prometheus text parser."""

import contextlib
import json
import re
import urllib.error
import urllib.request
import uuid

import pytest

from conftest import IDEM, Daemon, finish_daemons, free_port, payload, run_idem, wait_until


def idem(db, servers, *args, **kw):
    """Runs build/idem against this test's database and the session's broker."""
    return run_idem(*args, pg_url=db.url, amqp_url=servers.amqp_url, **kw)


def stderr_line(r):
    """The single line a failing command printed on stderr (fails on zero or several lines)."""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {r.stderr!r}"
    return lines[0]


def closed_port():
    """A loopback TCP port nothing listens on (bound then released)."""
    return free_port()


# ----------------------------------------------------------------------------- rows


def add_outbox(db, n, status="sent", event_type="invoice.paid", created_ago="0 seconds",
               sent_ago=None, attempts=0, last_error=None):
    """Inserts n outbox rows straight into event_outbox (bypassing idem_emit) and returns their
    event ids. Ages are PostgreSQL interval strings; sent_at defaults to created_at for 'sent'
    rows and NULL otherwise."""
    if sent_ago is None and status == "sent":
        sent_ago = created_ago
    rows = db.query(
        "INSERT INTO idem.event_outbox (event_id, subscription_id, event_type, payload, status, "
        "attempts, created_at, sent_at, last_error) "
        "SELECT gen_random_uuid(), gen_random_uuid(), %s, '{}'::jsonb, %s, %s, "
        "now() - %s::interval, now() - %s::interval, %s FROM generate_series(1, %s) "
        "RETURNING event_id::text",
        event_type, status, attempts, created_ago, sent_ago, last_error, n)
    return sorted(r[0] for r in rows)


def add_ledger(db, n, ago, consumer="billing"):
    """Inserts n ledger rows consumed `ago` (an interval string) ago; returns their event ids."""
    rows = db.query(
        "INSERT INTO idem.consumed_events (consumer, event_id, consumed_at) "
        "SELECT %s, gen_random_uuid(), now() - %s::interval FROM generate_series(1, %s) "
        "RETURNING event_id::text", consumer, ago, n)
    return sorted(r[0] for r in rows)


def outbox_ids(db, where="true", *params):
    return sorted(r[0] for r in db.query(
        f"SELECT event_id::text FROM idem.event_outbox WHERE {where}", *params))


def ledger_ids(db, where="true", *params):
    return sorted(r[0] for r in db.query(
        f"SELECT event_id::text FROM idem.consumed_events WHERE {where}", *params))


RETAIN_LINE = re.compile(
    r"^(event_outbox|consumed_events|idem_emitted_keys): deleted (\d+) rows in (\d+) batches$")


def parse_retain(stdout, keys=False):
    """{'event_outbox': (rows, batches), 'consumed_events': (rows, batches)} (plus
    'idem_emitted_keys' with keys=True), or 'skipped'. Fails unless stdout is exactly the
    contract's lines: one per table, the emitted-keys record being a table of its own."""
    lines = stdout.splitlines()
    if lines == ["skipped: another retention run is active"]:
        return "skipped"
    assert len(lines) == 3, f"unexpected retain output: {stdout!r}"
    out = {}
    for line in lines:
        m = RETAIN_LINE.match(line)
        assert m, f"unexpected retain line: {line!r}"
        out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    assert list(out) == ["event_outbox", "consumed_events", "idem_emitted_keys"], stdout
    if not keys:
        del out["idem_emitted_keys"]
    return out


def emit(db, event_type, body, key=None):
    """idem_emit in its own transaction; returns the event id."""
    return db.scalar("SELECT idem.idem_emit(%s, %s::uuid, %s, %s::jsonb)::text", event_type,
                     body["subscription_id"], key or uuid.uuid4().hex, json.dumps(body))


# ----------------------------------------------------------------------------- metrics


def scrape(port, path="/metrics"):
    """(status, content_type, text) of GET http://127.0.0.1:port/path."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return r.status, r.headers.get("Content-Type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def parse_prometheus(text):
    """{'samples': {(name, frozenset(labels)): value}, 'types': {name: type},
    'help': {name: text}}; fails on a line that is not valid text format 0.0.4."""
    samples, types, helps = {}, {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name, _, h = line[7:].partition(" ")
            helps[name] = h
            continue
        if line.startswith("# TYPE "):
            name, _, t = line[7:].partition(" ")
            assert t in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = t
            continue
        assert not line.startswith("#"), f"stray comment: {line!r}"
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        value = float(m.group(3))
        key = (m.group(1), labels)
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = value
    return {"samples": samples, "types": types, "help": helps}


def value(parsed, name, **labels):
    return parsed["samples"].get((name, frozenset(labels.items())))


# ----------------------------------------------------------------------------- relay daemon


class Relay(Daemon):
    """A running `idem relay` (daemon) with metrics on a private port."""

    def __init__(self, db, servers, workdir, args=()):
        self.metrics_port = free_port()
        super().__init__("relay", [IDEM, "relay", "--metrics-port", str(self.metrics_port), *args],
                         db, servers, workdir)

    def start(self):
        self.spawn()
        wait_until(self._up, 15, 0.1, "relay metrics endpoint")
        return self

    def _up(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"relay exited with {self.proc.returncode}:\n{self.log()}")
        with contextlib.suppress(OSError):
            return scrape(self.metrics_port)[0] == 200
        return False

    def metrics(self):
        status, _, text = scrape(self.metrics_port)
        assert status == 200
        return parse_prometheus(text)

    def stop(self, timeout=15):
        try:
            return super().stop(timeout)
        except AssertionError:
            self.kill()
            raise


@pytest.fixture
def relays(db, servers, tmp_path, request):
    """Factory: relays(args=[...]) -> a started Relay; stopped after the test."""
    started = []

    def make(args=()):
        r = Relay(db, servers, str(tmp_path), args)
        started.append(r)
        return r.start()

    yield make
    finish_daemons(started, request)


__all__ = ["idem", "stderr_line", "closed_port", "add_outbox", "add_ledger", "outbox_ids",
           "ledger_ids", "parse_retain", "emit", "scrape", "parse_prometheus", "value", "Relay",
           "relays", "payload", "wait_until"]
