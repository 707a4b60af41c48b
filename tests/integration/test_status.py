"""`idem status`: the JSON document's exact shape and values (the contract's keys, exactly; the
per-consumer view and why rows wait are more keys, test_status_explains_waiting_rows.py), the text
table, and the exit codes 0 (ok), 1 (oldest pending row older than --max-age) and 3 (database
unreachable or unqueryable)."""

import datetime
import json

from conftest import run_idem
from ops_helpers import add_ledger, add_outbox, closed_port, idem, stderr_line

TOP_KEYS = {"event_types", "totals", "ledger"}  # the contract's; more keys are allowed
TYPE_KEYS = {"event_type", "pending", "oldest_pending_seconds", "failed"}
TOTAL_KEYS = {"pending", "failed", "oldest_pending_seconds"}
LEDGER_KEYS = {"rows", "oldest_consumed_at"}


def status_json(db, servers, *args):
    r = idem(db, servers, "status", "--json", *args)
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    return r, doc


def contract(doc):
    """The contract's part of the document."""
    return {k: doc[k] for k in TOP_KEYS}


def check_shape(doc):
    assert TOP_KEYS <= set(doc)
    assert isinstance(doc["event_types"], list)
    for t in doc["event_types"]:
        assert set(t) == TYPE_KEYS
        assert isinstance(t["event_type"], str)
        assert type(t["pending"]) is int and type(t["failed"]) is int
        assert t["oldest_pending_seconds"] is None or isinstance(t["oldest_pending_seconds"],
                                                                  (int, float))
    assert set(doc["totals"]) == TOTAL_KEYS
    assert type(doc["totals"]["pending"]) is int and type(doc["totals"]["failed"]) is int
    assert set(doc["ledger"]) == LEDGER_KEYS
    assert type(doc["ledger"]["rows"]) is int


def test_empty_database(db, servers):
    r, doc = status_json(db, servers)
    assert r.returncode == 0
    check_shape(doc)
    assert contract(doc) == {
        "event_types": [],
        "totals": {"pending": 0, "failed": 0, "oldest_pending_seconds": None},
        "ledger": {"rows": 0, "oldest_consumed_at": None},
    }
    # the document is one JSON value on stdout, nothing else
    assert r.stdout.count("\n") == 1 and r.stderr == ""


def test_backlog_document(db, servers):
    add_outbox(db, 3, "pending", "invoice.paid", created_ago="10 minutes")
    add_outbox(db, 2, "pending", "invoice.paid", created_ago="1 minute")
    add_outbox(db, 1, "failed", "invoice.paid", created_ago="2 days", attempts=8)
    add_outbox(db, 2, "failed", "payment.failed", created_ago="3 days", attempts=8)
    add_outbox(db, 4, "pending", "receipt.requested", created_ago="30 seconds")
    add_outbox(db, 7, "sent", "refund.issued", created_ago="1 hour")  # not listed: nothing due
    add_ledger(db, 5, "3 days 2 hours", consumer="billing")
    add_ledger(db, 6, "1 hour", consumer="receipts")
    oldest_consumed = db.scalar("SELECT min(consumed_at) FROM idem.consumed_events")

    r, doc = status_json(db, servers)
    assert r.returncode == 0, r.stderr
    check_shape(doc)
    types = {t["event_type"]: t for t in doc["event_types"]}
    assert sorted(types) == ["invoice.paid", "payment.failed", "receipt.requested"]
    assert types["invoice.paid"]["pending"] == 5
    assert types["invoice.paid"]["failed"] == 1
    assert 600 <= types["invoice.paid"]["oldest_pending_seconds"] < 660
    assert types["payment.failed"] == {"event_type": "payment.failed", "pending": 0,
                                      "oldest_pending_seconds": None, "failed": 2}
    assert types["receipt.requested"]["pending"] == 4
    assert types["receipt.requested"]["failed"] == 0
    assert 30 <= types["receipt.requested"]["oldest_pending_seconds"] < 90

    assert doc["totals"]["pending"] == 9
    assert doc["totals"]["failed"] == 3
    assert doc["totals"]["oldest_pending_seconds"] == types["invoice.paid"]["oldest_pending_seconds"]

    assert doc["ledger"]["rows"] == 11
    ts = doc["ledger"]["oldest_consumed_at"]
    assert ts.endswith("Z"), ts  # RFC 3339, UTC
    parsed = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    assert parsed.utcoffset() == datetime.timedelta(0)
    assert abs((parsed - oldest_consumed).total_seconds()) < 1.0


def test_text_output(db, servers):
    add_outbox(db, 2, "pending", "invoice.paid", created_ago="5 minutes")
    add_outbox(db, 1, "failed", "payment.failed", created_ago="1 day")
    add_ledger(db, 4, "1 day")
    r = idem(db, servers, "status")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()}
    assert "invoice.paid" in rows and "payment.failed" in rows
    assert rows["invoice.paid"][1] == "2"
    assert rows["payment.failed"][-1] == "1"
    assert rows["total"][1] == "2" and rows["total"][-1] == "1"
    assert any(line.startswith("ledger: 4 rows") for line in lines), r.stdout


def test_max_age_exit_codes(db, servers):
    # no pending rows at all: never over the threshold (failed rows do not count)
    add_outbox(db, 1, "failed", created_ago="10 days")
    r = idem(db, servers, "status", "--max-age", "1s")
    assert r.returncode == 0, r.stderr

    add_outbox(db, 1, "pending", created_ago="10 minutes")
    r = idem(db, servers, "status", "--max-age", "1h")
    assert r.returncode == 0, r.stderr
    r = idem(db, servers, "status", "--max-age", "5m")
    assert r.returncode == 1, r.stderr
    assert "max-age" in r.stderr
    r, doc = status_json(db, servers, "--max-age", "9m")
    assert r.returncode == 1
    check_shape(doc)  # the document is still printed when over the threshold
    r, _ = status_json(db, servers, "--max-age", "11m")
    assert r.returncode == 0


def test_unreachable_server_exits_3(servers):
    port = closed_port()
    r = run_idem("status", "--pg", f"postgresql://u:secret@127.0.0.1:{port}/x")
    assert r.returncode == 3, (r.stdout, r.stderr)
    line = stderr_line(r)
    assert line.startswith(f"idem status: cannot connect to PostgreSQL at 127.0.0.1:{port}: "), line
    assert "secret" not in r.stderr + r.stdout
    assert r.stdout == ""
    r = run_idem("status", "--json", "--pg", f"host=127.0.0.1 port={port} password=secret")
    assert r.returncode == 3
    assert "secret" not in r.stderr + r.stdout


def test_unknown_database_exits_3(servers):
    r = run_idem("status", "--json", pg_url=servers.db_url("no_such_database_here"))
    assert r.returncode == 3
    assert stderr_line(r).startswith("idem status: cannot connect to PostgreSQL at ")


def test_unmigrated_database_exits_1_naming_migrate(servers):
    """Reachable but not migrated (no schema idem): the start check's one line naming `idem
    migrate`, exit 1, as for every command (contract, "Commands")."""
    r = run_idem("status", pg_url=servers.db_url("postgres"))
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = stderr_line(r)
    assert line.startswith("idem status: ") and line.endswith("run idem migrate"), line


def test_bad_max_age_is_usage_error(db, servers):
    for bad in ("30", "5x", "-1m", ""):
        r = idem(db, servers, "status", "--max-age", bad)
        assert r.returncode == 2, (bad, r.stderr)
        assert stderr_line(r).startswith("idem status: ")
