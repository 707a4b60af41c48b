"""The console in a real browser (headless Chromium): the page loads under its strict
Content-Security-Policy with no error, shows hostile text as text, and its buttons work as a
person clicks them: Replay on a failed row and Requeue on a dead letter get the events applied
(once) by a running relay and consumer, Discard (two clicks) removes a dead letter; it fits a
phone's width. Screenshots of a real backlog go to $IDEM_CONSOLE_SCREENSHOTS when set (that is
how docs/console.png is made), else to the test's temp dir."""

import json
import os
import time

import pytest

from browser_helpers import browser  # noqa: F401
from conftest import EXCHANGE, new_id, payload, wait_until
from console_helpers import TOKEN, consoles  # noqa: F401
from ops_helpers import emit, relays  # noqa: F401
from test_dlq_show_and_discard import fill_dlq
from test_failing_handler_retried_then_dead_lettered import inject_failure, remove_failure
from relay_helpers import relay_once
from test_replay import park

HOSTILE_TYPE = "<img src=x onerror=\"window.pwned=1\">"


def button(action, event_id):
    return f'button[data-action="{action}"][data-event-id="{event_id}"]'


def test_replay_requeue_and_discard_clicked_in_the_page(db, servers, broker, queue, consumers,
                                                        relays, consoles, browser):
    sub_r, sub_q = new_id(), new_id()
    replay_id = emit(db, "payment.failed", payload(subscription_id=sub_r))
    park(db, replay_id, error="basic.return: 312 NO_ROUTE <script>window.pwned=2</script>")
    inject_failure(db, "billing.dunning", "P0001")
    c = consumers("billing", queue, db)
    requeue_id = broker.publish_event("payment.failed", payload(subscription_id=sub_q))
    discard_id = new_id()
    broker.publish_raw(json.dumps(payload()), routing_key="payment.failed",
                       message_id=discard_id, type=HOSTILE_TYPE, timestamp=int(time.time()))
    c.wait_metric("idem_consumer_dead_lettered_total", 2)
    remove_failure(db, "billing.dunning")  # the cause is fixed: now the operator acts
    relays()
    con = consoles(db, queues=[queue])

    page = browser.page()
    page.open(con.base + "/#token=" + TOKEN)
    page.wait(f"document.querySelector('{button('replay', replay_id)}')", what="the failed row")
    page.wait(f"document.querySelector('{button('requeue', requeue_id)}')", what="dead letters")
    assert page.eval("location.hash") == ""  # the token left the address bar
    # hostile text is text: shown as it is, nothing of it ran or became an element
    texts = page.eval("[...document.querySelectorAll('td')].map(td => td.textContent)")
    assert HOSTILE_TYPE in texts
    assert any("<script>window.pwned=2</script>" in t for t in texts)
    assert page.eval("window.pwned === undefined && document.querySelectorAll('img').length "
                     "=== 0 && document.scripts.length === 1")

    page.click(button("replay", replay_id))
    page.wait("document.getElementById('notice').textContent.startsWith('Replayed')",
              what="the replay's notice")
    wait_until(lambda: db.dunning_step(sub_r) == 1, 30, 0.2, "the replayed event applied")
    # the replayed row leaves the failed table at the page's next refresh, which moves the dead
    # letters up: click once the page has drawn that, not where the button was before
    page.wait(f"!document.querySelector('{button('replay', replay_id)}')",
              what="the replayed row gone from the page")

    page.click(button("requeue", requeue_id))
    page.wait("document.getElementById('notice').textContent.startsWith('Requeued')",
              what="the requeue's notice")
    wait_until(lambda: db.dunning_step(sub_q) == 1, 30, 0.2, "the requeued event applied")

    page.click(button("discard", discard_id))  # the first click only asks
    page.wait(f"document.querySelector('{button('confirm-discard', discard_id)}')")
    assert broker.depth(queue + ".dlq") == 1
    page.click(button("confirm-discard", discard_id))
    page.wait("document.getElementById('notice').textContent.startsWith('Discarded')",
              what="the discard's notice")
    assert broker.depth(queue + ".dlq") == 0

    # the page follows by itself: no failed row, no dead letter left
    page.wait("document.querySelector('#failed td.empty') && "
              "document.querySelector('#dlqs td.empty')", what="the page refreshed")
    page.drain()
    assert page.problems() == []
    assert c.stop() == 0
    assert sorted(e for _, e in db.ledger("billing")) == sorted([replay_id, requeue_id])
    assert [db.dunning_step(s) for s in (sub_r, sub_q)] == [1, 1]


def test_read_only_page_and_a_phone(db, servers, broker, queue, consoles, browser, tmp_path):
    eid = emit(db, "payment.failed", payload())
    park(db, eid)
    fill_dlq(broker, queue, [(new_id(), "handler_rejected")])
    con = consoles(db, queues=[queue], token=False)
    page = browser.page()
    page.open(con.base + "/", width=390, height=844, mobile=True, scale=2)
    page.wait(f"document.querySelector('{button('replay', eid)}')")
    assert page.eval(f"document.querySelector('{button('replay', eid)}').disabled")
    assert page.eval("[...document.querySelectorAll('button[data-action=requeue]')]"
                     ".every(b => b.disabled)")
    assert "Read-only" in page.eval("document.getElementById('mode').textContent")
    # nothing wider than the phone but the tables' own scroll boxes
    wide = page.eval("[...document.querySelectorAll('*')].filter(e => "
                     "e.getBoundingClientRect().right > 391).map(e => e.tagName + '.' + "
                     "e.className + ' ' + e.textContent.slice(0, 40))")
    assert page.eval("document.documentElement.scrollWidth") <= 391, wide
    page.drain()
    assert page.problems() == []
    png = page.screenshot(str(tmp_path / "phone.png"))
    assert png.startswith(b"\x89PNG")


@pytest.mark.slow  # about 35 s: failed rows parked by the relay, a backlog grown over 8 s of
# samples, two screenshots
def test_screenshots_of_a_real_backlog(db, servers, broker, queues, consoles, browser, tmp_path):
    out = os.environ.get("IDEM_CONSOLE_SCREENSHOTS") or str(tmp_path)
    tag = new_id()[:4]
    billing, ledger = f"billing.{tag}", f"ledger.{tag}"
    queues.names += [billing, ledger]  # deleted after the test
    # failed rows as the relay parks them: rows the broker would not take, one attempt each
    # (--max-attempts 1): a type no queue is bound to (returned unroutable), one whose only queue
    # is full and refuses more (nacked), one with a header too large for an AMQP frame
    full = f"full.{tag}"
    queues.names.append(full)
    with broker.channel() as ch:
        broker.declare_exchange(ch)
        ch.queue_declare(queue=full, durable=True,
                         arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
        ch.queue_bind(queue=full, exchange=EXCHANGE, routing_key="invoice.paid")
    failed = [db.scalar("SELECT idem.idem_emit(%s, gen_random_uuid(), gen_random_uuid()::text, "
                        "%s::jsonb, %s::jsonb)::text", t, json.dumps(payload()),
                        json.dumps(headers) if headers else None)
              for t, headers in (("invoice.voided", None), ("invoice.paid", None),
                                 ("payment.failed", {"trace": "t" * 200000}))]
    for _ in range(5):
        r = relay_once(db, servers, "--max-attempts", "1")
        assert r.returncode == 0, r.stderr
        if db.count("idem.event_outbox", "status = 'failed'") == len(failed):
            break
    parked = db.query("SELECT event_id::text, last_error FROM idem.event_outbox "
                      "WHERE status = 'failed'")
    assert sorted(e for e, _ in parked) == sorted(failed), parked
    assert all(err for _, err in parked), parked
    with broker.channel() as ch:  # the backlog that follows goes nowhere: no relay runs
        ch.queue_unbind(queue=full, exchange=EXCHANGE, routing_key="invoice.paid")
    fill_dlq(broker, billing, [
        (new_id(), "handler_rejected", "SQLSTATE P0001: dunning: subscription is closed"),
        (new_id(), "malformed_json", "'[' or '{' expected near 'oops'"),
        (new_id(), "invalid_payload", "currency: 'usd' is not 3 uppercase letters")])
    fill_dlq(broker, ledger, [(new_id(), "retries_exhausted",
                               "SQLSTATE 40001: could not serialize access (6 tries)")])
    con = consoles(db, queues=[billing, ledger], args=["--sample-interval", "1s"])
    # a backlog that grows while the console samples it (no relay runs)
    for step in range(8):
        for t, n in (("invoice.paid", 6), ("payment.failed", 3), ("receipt.requested", 1)):
            db.execute("SELECT idem.idem_emit(%s, gen_random_uuid(), gen_random_uuid()::text, "
                       "%s::jsonb) FROM generate_series(1, %s)", t, json.dumps(payload()),
                       n * (1 + step % 3))
        time.sleep(1)
    db.execute("UPDATE idem.event_outbox SET created_at = created_at - interval '7 minutes' "
               "WHERE event_id = (SELECT event_id FROM idem.event_outbox WHERE status = 'pending' "
               "AND event_type = 'invoice.paid' ORDER BY created_at LIMIT 1)")
    time.sleep(1.5)
    page = browser.page()
    page.open(con.base + "/#token=" + TOKEN, width=1280, height=900)
    # four types: the backlog's three, and invoice.voided with its failed row only
    page.wait("document.querySelectorAll('#backlog tbody tr').length === 4 && "
              "!document.getElementById('banner').hidden", what="the backlog and its banner")
    page.wait("document.querySelectorAll('#dlqs td.id').length === 4", what="the dead letters")
    first = page.eval("document.querySelector('#dlqs td.id').textContent")
    page.click(button("show", first))
    page.wait("!document.getElementById('detail').hidden", what="a dead letter shown")
    points = page.eval("document.querySelector('#backlog svg polyline')"
                       ".getAttribute('points').split(' ').length")
    assert points >= 5
    assert "old" in page.eval("document.getElementById('banner').textContent")
    desktop = page.screenshot(os.path.join(out, "console.png"))
    page.open(con.base + "/#token=" + TOKEN, width=390, height=844, mobile=True, scale=2)
    page.wait("document.querySelectorAll('#backlog tbody tr').length === 4")
    page.eval("window.scrollTo(0, 0)")
    phone = page.screenshot(os.path.join(out, "console-phone.png"), full=False)
    for png in (desktop, phone):
        assert png.startswith(b"\x89PNG") and len(png) > 20000
    page.drain()
    assert page.problems() == []
