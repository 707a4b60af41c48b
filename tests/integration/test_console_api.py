"""`idem console`'s JSON API: the reads are what the CLI prints (status --json, failed --json,
dlq list/show); actions need the bearer token (401 without, 403 wrong, 403 when read-only) and
follow the CLI's rules because they call the same library functions (replay refuses stale rows);
hostile event types, errors and dead-letter details come back as JSON strings, the page has no
inline script and a strict Content-Security-Policy; oversized requests, unknown queues and
foreign Host headers are refused."""

import contextlib
import json
import os
import re
import socket
import subprocess
import time

import pika
import pytest

from conftest import IDEM, new_id, payload, run_idem, wait_until
from console_helpers import TOKEN, consoles  # noqa: F401
from ops_helpers import emit, idem
from test_dlq_show_and_discard import fill_dlq
from test_replay import park

HOSTILE_TYPE = '<script>alert("t")</script>'
HOSTILE_ERROR = "<img src=x onerror=alert(1)> & \u2028 \"quoted\""
HOSTILE_DETAIL = "<script>document.title='pwned'</script>"


def dlq_letter(broker, queue, eid, event_type, detail, body=b"{}"):
    with broker.channel() as ch:
        ch.queue_declare(queue=queue + ".dlq", durable=True)
        ch.basic_publish(exchange="", routing_key=queue + ".dlq", body=body,
                         properties=pika.BasicProperties(
                             message_id=eid, type=event_type, delivery_mode=2,
                             timestamp=int(time.time()),
                             headers={"x-idem-error": f"handler_rejected: {detail}"}))


def raw_http(port, data, timeout=10):
    """Sends data as it is; returns what came back before the server closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_reads_are_what_the_cli_prints(db, servers, broker, queue, consoles):
    eid = emit(db, "payment.failed", payload())
    emit(db, "invoice.paid", payload())
    park(db, eid, error="basic.return: 312 NO_ROUTE")
    letter = new_id()
    fill_dlq(broker, queue, [(letter, "handler_rejected")])
    c = consoles(db, queues=[queue], args=["--sample-interval", "1s", "--max-age", "90s"])

    status = c.json("/api/status")
    cli = json.loads(idem(db, servers, "status", "--json").stdout)
    # the contract's keys (more are allowed: the CLI also explains why rows wait)
    assert {"event_types", "totals", "ledger"} <= set(status) <= set(cli)
    strip = [{k: v for k, v in t.items() if k != "oldest_pending_seconds"}
             for t in status["event_types"]]
    assert strip == [{k: v for k, v in t.items() if k != "oldest_pending_seconds"}
                     for t in cli["event_types"]]
    assert status["totals"]["pending"] == 1 and status["totals"]["failed"] == 1

    assert c.json("/api/failed") == json.loads(idem(db, servers, "failed", "--json").stdout)
    got = c.json("/api/dlq?queue=" + queue)
    assert [m["event_id"] for m in got] == [letter] and got[0]["code"] == "handler_rejected"
    one = c.json(f"/api/dlq/message?queue={queue}&event_id={letter.upper()}")
    assert one["event_id"] == letter and one["headers"]["x-idem-error"].startswith("handler_")
    assert broker.depth(queue + ".dlq") == 1  # shown, not taken

    conf = c.json("/api/config")
    assert conf == {"queues": [queue], "actions": True, "max_age_seconds": 90.0,
                    "sample_seconds": 1.0}
    # the console samples the backlog by itself for the sparklines
    hist = wait_until(lambda: (lambda h: h if len(h) >= 2 else None)(c.json("/api/history")),
                      15, 0.5, "two backlog samples")
    assert hist[-1]["pending"] == 1 and hist[-1]["types"]["invoice.paid"][0] == 1
    assert hist[-1]["t"] >= hist[0]["t"]


def test_actions_need_the_token_and_follow_the_cli_rules(db, servers, consoles):
    fresh = emit(db, "payment.failed", payload())
    stale = emit(db, "payment.failed", payload())
    pending = emit(db, "payment.failed", payload())
    park(db, fresh)
    park(db, stale, age="31 days")
    c = consoles(db)

    status, body = c.post("/api/replay", {"event_id": fresh}, token=None)
    assert status == 401 and "Bearer" in body["error"]
    s, h, _ = c.request("POST", "/api/replay", {"event_id": fresh}, token=None)
    assert h.get("WWW-Authenticate", "").startswith("Bearer")
    assert c.post("/api/replay", {"event_id": fresh}, token="wrong")[0] == 403
    assert c.post("/api/replay", {"event_id": fresh}, token=TOKEN[:-1])[0] == 403
    assert c.post("/api/replay", {"event_id": fresh}, token=TOKEN + "x")[0] == 403
    assert db.scalar("SELECT status FROM idem.event_outbox WHERE event_id = %s", fresh) == "failed"
    # a JSON body only (a form post from another site cannot be one without a preflight)
    s, _, _ = c.request("POST", "/api/replay", raw=json.dumps({"event_id": fresh}).encode(),
                        headers={"Content-Type": "text/plain"})
    assert s == 415

    # the CLI's rules: a stale row is refused and stays failed, a row that is not failed is 404
    status, body = c.post("/api/replay", {"event_id": stale})
    assert status == 409 and "dedup window" in body["error"], body
    assert db.scalar("SELECT status FROM idem.event_outbox WHERE event_id = %s", stale) == "failed"
    assert c.post("/api/replay", {"event_id": pending})[0] == 404
    assert c.post("/api/replay", {"event_id": "not-a-uuid"})[0] == 400
    assert c.post("/api/replay", {"nothing": 1})[0] == 400

    status, body = c.post("/api/replay", {"event_id": fresh.upper()})
    assert (status, body) == (200, {"replayed": 1})
    assert db.query("SELECT status, attempts FROM idem.event_outbox WHERE event_id = %s",
                    fresh)[0] == ("pending", 0)
    assert "replay" in c.log() and fresh in c.log() and TOKEN not in c.log()


def test_read_only_without_a_token_file(db, servers, broker, queue, consoles):
    eid = emit(db, "payment.failed", payload())
    park(db, eid)
    letter = new_id()
    fill_dlq(broker, queue, [(letter, "handler_rejected")])
    c = consoles(db, queues=[queue], token=False)
    assert c.json("/api/config")["actions"] is False
    for path, body in (("/api/replay", {"event_id": eid}),
                       ("/api/dlq/requeue", {"queue": queue, "event_id": letter}),
                       ("/api/dlq/discard", {"queue": queue, "event_id": letter})):
        status, got = c.post(path, body, token=TOKEN)
        assert status == 403 and "read-only" in got["error"], (path, got)
        assert c.post(path, body, token=None)[0] == 403
    assert db.scalar("SELECT status FROM idem.event_outbox WHERE event_id = %s", eid) == "failed"
    assert broker.depth(queue + ".dlq") == 1
    assert c.json("/api/failed")[0]["event_id"] == eid  # reads still work


def test_dlq_requeue_and_discard_by_id(db, servers, broker, queue, consoles):
    a, b, other = new_id(), new_id(), new_id()
    fill_dlq(broker, queue, [(a, "handler_rejected"), (b, "malformed_json"),
                             (other, "handler_rejected")])
    with broker.channel() as ch:
        ch.queue_declare(queue=queue, durable=True)
    c = consoles(db, queues=[queue])
    status, body = c.post("/api/dlq/discard", {"queue": queue, "event_id": b})
    assert (status, body) == (200, {"discarded": 1})
    status, body = c.post("/api/dlq/requeue", {"queue": queue, "event_id": a})
    assert (status, body) == (200, {"requeued": 1})
    assert [m["event_id"] for m in c.json("/api/dlq?queue=" + queue)] == [other]
    moved = broker.get_all(queue)
    assert [m.props.message_id for m in moved] == [a] and moved[0].error is None
    assert moved[0].headers.get("x-idem-requeued") == 1
    # again: nothing left of them
    assert c.post("/api/dlq/discard", {"queue": queue, "event_id": b}) == (200, {"discarded": 0})
    # the queue can come as a parameter too, and must be one of --queue
    s, _, _ = c.request("POST", "/api/dlq/discard?queue=" + queue, {"event_id": other})
    assert s == 200 and broker.depth(queue + ".dlq") == 0


def test_hostile_text_comes_back_as_json_strings_and_the_page_runs_no_inline_script(
        db, servers, broker, queue, consoles):
    eid = emit(db, HOSTILE_TYPE, payload())
    park(db, eid, error=HOSTILE_ERROR)
    letter = new_id()
    dlq_letter(broker, queue, letter, HOSTILE_TYPE, HOSTILE_DETAIL,
               body=b"<script>alert(2)</script>\xff")
    c = consoles(db, queues=[queue])

    for path in ("/api/status", "/api/failed", "/api/dlq?queue=" + queue, "/api/history",
                 f"/api/dlq/message?queue={queue}&event_id={letter}"):
        status, h, raw = c.get(path)
        assert status == 200, (path, raw)
        assert h["Content-Type"] == "application/json"
        assert h["X-Content-Type-Options"] == "nosniff"
        assert "default-src 'self'" in h["Content-Security-Policy"]
        assert "Set-Cookie" not in h
        assert b"<script" not in raw or path.startswith("/api/"), raw
        json.loads(raw)  # valid JSON: strings escaped as JSON
    assert c.json("/api/status")["event_types"][0]["event_type"] == HOSTILE_TYPE
    failed = c.json("/api/failed")[0]
    assert failed["event_type"] == HOSTILE_TYPE and failed["last_error"] == HOSTILE_ERROR
    m = c.json("/api/dlq?queue=" + queue)[0]
    assert m["event_type"] == HOSTILE_TYPE and m["detail"] == HOSTILE_DETAIL
    one = c.json(f"/api/dlq/message?queue={queue}&event_id={letter}")
    assert one["body"] == "<script>alert(2)</script>\\xff" and one["body_escaped"] is True

    # the page: static files only, no inline script or style, every answer with the policy
    status, h, page = c.get("/")
    assert status == 200 and h["Content-Type"].startswith("text/html")
    csp = h["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert h["X-Content-Type-Options"] == "nosniff" and "Set-Cookie" not in h
    html = page.decode()
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S | re.I)
    assert scripts and all(s.strip() == "" for s in scripts)
    assert all('src="/' in tag for tag in re.findall(r"<script\b[^>]*>", html, re.I))
    assert not re.search(r"\son[a-z]+\s*=", html, re.I) and "style=" not in html.lower()
    assert "<style" not in html.lower()
    status, h, js = c.get("/console.js")
    assert status == 200 and h["Content-Type"].startswith("text/javascript")
    js = js.decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in js, sink
    assert c.get("/console.css")[1]["Content-Type"].startswith("text/css")
    assert c.get("/nope")[0] == 404


def test_bad_requests_are_refused(db, servers, broker, queue, consoles):
    letter = new_id()
    fill_dlq(broker, queue, [(letter, "handler_rejected")])
    c = consoles(db, queues=[queue])
    # unknown queues, for reading and for acting
    assert c.get("/api/dlq?queue=" + queue + "x")[0] == 404
    assert c.get("/api/dlq")[0] == 404
    other = queue + ".other"
    assert c.post("/api/dlq/discard", {"queue": other, "event_id": letter})[0] == 404
    assert c.post("/api/dlq/requeue", {"queue": other, "event_id": letter})[0] == 404
    assert c.get(f"/api/dlq/message?queue={queue}&event_id={new_id()}")[0] == 404
    assert c.get(f"/api/dlq/message?queue={queue}&event_id=x")[0] == 400
    # oversized body and head, malformed JSON, another method, another Host
    big = json.dumps({"event_id": letter, "pad": "x" * 9000}).encode()
    assert c.request("POST", "/api/dlq/discard", raw=big)[0] == 413
    assert c.request("GET", "/api/status", headers={"X-Pad": "y" * 5000})[0] == 431
    assert c.request("POST", "/api/dlq/discard", raw=b"{not json")[0] == 400
    assert c.request("PUT", "/api/status", raw=b"{}")[0] == 405
    assert c.request("GET", "/api/replay")[0] == 405
    assert c.request("GET", "/api/status", headers={"Host": "evil.example:80"})[0] == 403
    assert c.request("GET", "/api/status", headers={"Host": f"localhost:{c.port}"})[0] == 200
    r = raw_http(c.port, b"POST /api/replay HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                 b"Content-Length: 99999999999\r\n\r\n" % c.port)
    assert r.startswith(b"HTTP/1.1 413"), r
    r = raw_http(c.port, b"POST /api/replay HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                 b"Content-Length: -1\r\n\r\n" % c.port)
    assert r.startswith(b"HTTP/1.1 400"), r
    assert broker.depth(queue + ".dlq") == 1  # nothing of that touched it
    assert c.running()


def test_token_file_and_listen_checked_at_start(db, servers, tmp_path):
    loose = tmp_path / "token"
    loose.write_text(TOKEN + "\n")
    os.chmod(loose, 0o644)  # others may read it (root's file: group alone would be allowed)
    r = run_idem("console", "--token-file", str(loose), "--listen", "127.0.0.1:1",
                 pg_url=db.url, amqp_url=servers.amqp_url, timeout=10)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "group or others" in r.stderr and TOKEN not in r.stderr
    os.chmod(loose, 0o600)
    loose.write_text("short\n")
    r = run_idem("console", "--token-file", str(loose), pg_url=db.url, timeout=10)
    assert r.returncode == 1 and "shorter than 16" in r.stderr
    for bad in ("8080", "127.0.0.1:0", "127.0.0.1:99999", "localhost:80x"):
        r = run_idem("console", "--listen", bad, pg_url=db.url, timeout=10)
        assert r.returncode == 2, (bad, r.stderr)
    r = run_idem("console", "--listen", "not-an-ip:8080", pg_url=db.url, timeout=10)
    assert r.returncode == 1 and "not a numeric IP address" in r.stderr
    r = subprocess.run([IDEM, "console", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "127.0.0.1:8080" in r.stdout and "--token-file" in r.stdout


@pytest.mark.slow  # 25,000 dead letters: 10-25 s
def test_a_slow_action_does_not_cost_the_others_their_answer(db, servers, broker, queue,
                                                             consoles):
    # enough dead letters that walking them outlasts the server's read deadline (2 s) on a quiet
    # machine too: 6,000 took 1.4 s
    n = 25000
    letters = [(new_id(), "handler_rejected") for _ in range(n)]
    fill_dlq(broker, queue, letters)
    with broker.channel() as ch:
        ch.queue_declare(queue=queue, durable=True)
    c = consoles(db, queues=[queue])
    import threading
    got = {}
    # a connection the server has accepted, as a browser opens several at once
    other = socket.create_connection(("127.0.0.1", c.port), timeout=30)
    t0 = time.monotonic()
    time.sleep(0.5)

    def requeue():
        got["r"] = c.post("/api/dlq/requeue", {"queue": queue, "event_id": letters[-1][0]})
        got["done"] = time.monotonic()

    t = threading.Thread(target=requeue)
    t.start()
    time.sleep(0.3)
    # its request comes while the requeue walks the DLQ (on one of the server's workers): it is
    # answered, not dropped at the read deadline for the time the requeue takes
    other.sendall(b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % c.port)
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := other.recv(65536):
            answer += chunk
    other.close()
    t.join(60)
    assert got["r"] == (200, {"requeued": 1})
    age = got["done"] - t0  # of the waiting connection when the requeue was answered
    assert age > 2.3, f"the requeue was over after {age:.1f}s, within the read deadline"
    assert answer.startswith(b"HTTP/1.1 200"), answer
