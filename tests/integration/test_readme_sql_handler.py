"""The SQL handler example of docs/handlers.md (section "In SQL") works as written.

Its SQL blocks run as they stand: the schema and PL/pgSQL function (with the grants for the
least-privilege consumer role), then the application's emit with a traceparent header. Its
`idem consume` line supplies the --handler flag. Then `idem relay --once` publishes the event,
the consumer calls the function in the claim's transaction, and:
- the paid invoice is recorded once, with the emitting request's traceparent (emit -> relay ->
  message header -> the function's headers argument);
- a second delivery of the same event writes nothing (the ledger);
- an invoice.paid without invoice_id hits the function's RAISE and is dead-lettered at once as
  handler_rejected, writing nothing.
"""

import json
import os
import re
import shlex

from conftest import REPO, new_id, run_idem

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def readme_sql_section():
    with open(os.path.join(REPO, "docs", "handlers.md")) as f:
        page = f.read()
    m = re.search(r"^## In SQL\n(.*?)(?=^## )", page, re.M | re.S)
    assert m, 'docs/handlers.md has no "## In SQL" section'
    return m.group(1)


def blocks(section, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", section, re.M | re.S)


def test_readme_sql_handler_runs_as_written(db, servers, queue, consumers, broker,
                                            dead_letters):
    section = readme_sql_section()
    sql = blocks(section, "sql")
    sh = blocks(section, "sh")
    assert len(sql) == 2 and len(sh) == 1, (len(sql), len(sh))
    schema, emit = sql

    words = shlex.split(sh[0].strip())
    assert words[:2] == ["idem", "consume"], words
    handler_args = []
    for i, w in enumerate(words):
        if w == "--handler":
            handler_args += ["--handler", words[i + 1]]
    assert handler_args == ["--handler", "invoice.paid=crm.on_invoice_paid"], words

    db.execute(schema)
    c = consumers("crm", queue, db, args=handler_args)

    db.execute(emit)
    (event_id, sub, payload_text), = db.query(
        "SELECT event_id::text, subscription_id::text, payload::text FROM idem.event_outbox "
        "WHERE event_type = 'invoice.paid'")
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=servers.amqp_url, timeout=60)
    assert r.returncode == 0, r.stderr
    c.wait_metric("idem_consumer_applied_total", 1)

    rows = db.query("SELECT invoice_id::text, subscription_id::text, amount_cents, "
                    "event_id::text, traceparent FROM crm.paid_invoices")
    body = json.loads(payload_text)
    assert rows == [(body["invoice_id"], sub, 4900, event_id, TRACEPARENT)]

    # the same event again: the ledger absorbs it
    broker.publish_event("invoice.paid", body, event_id=event_id)
    c.wait_metric("idem_consumer_duplicates_total", 1)
    assert db.count("crm.paid_invoices") == 1

    # no invoice_id: the function's RAISE dead-letters it at once, nothing written
    bad = broker.publish_event("invoice.paid", {"subscription_id": sub, "amount_cents": 1,
                                                "currency": "EUR"}, event_id=new_id())
    letters = dead_letters(queue)
    letters.wait(1, timeout=10)
    assert letters.got[0].props.message_id == bad
    assert letters.got[0].error.startswith("handler_rejected: "), letters.got[0].error
    assert "has no invoice_id" in letters.got[0].error
    assert c.stop() == 0
    assert db.count("crm.paid_invoices") == 1
    assert sorted(e for _, e in db.ledger()) == [event_id]
