"""`idem retain`: deletes exactly the old sent outbox rows and old ledger rows, in bounded
batches; never pending/failed/recent rows; one run at a time; refuses unsafe windows."""

import signal
import subprocess
import threading
import time

import psycopg2

from conftest import IDEM
from ops_helpers import (add_ledger, add_outbox, idem, ledger_ids, outbox_ids, parse_retain,
                         stderr_line, wait_until)


def seed(db):
    """Old and recent rows of every kind; returns the ids that must survive."""
    add_outbox(db, 35, "sent", created_ago="9 days", sent_ago="8 days")
    keep = []
    keep += add_outbox(db, 5, "sent", created_ago="2 days", sent_ago="1 day")
    keep += add_outbox(db, 3, "sent", created_ago="9 days", sent_ago="6 days 23 hours")
    # never candidates, however old: pending and failed rows (even with a stray sent_at)
    keep += add_outbox(db, 4, "pending", created_ago="40 days")
    keep += add_outbox(db, 2, "failed", created_ago="40 days", attempts=8, last_error="nacked")
    keep += add_outbox(db, 1, "failed", created_ago="40 days", sent_ago="39 days")
    keep += add_outbox(db, 1, "pending", created_ago="40 days", sent_ago="39 days")
    add_ledger(db, 35, "31 days 1 hour", consumer="billing")
    keep_ledger = add_ledger(db, 4, "29 days", consumer="billing")
    keep_ledger += add_ledger(db, 3, "1 hour", consumer="other")
    return sorted(keep), sorted(keep_ledger)


def test_deletes_exactly_old_rows_in_batches(db, servers):
    keep, keep_ledger = seed(db)
    r = idem(db, servers, "retain", "--batch", "10")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (35, 4), "consumed_events": (35, 4)}
    assert r.stdout == ("event_outbox: deleted 35 rows in 4 batches\n"
                        "consumed_events: deleted 35 rows in 4 batches\n"
                        "idem_emitted_keys: deleted 0 rows in 0 batches\n")
    assert outbox_ids(db) == keep
    assert ledger_ids(db) == keep_ledger
    # untouched rows kept their state
    assert db.count("idem.event_outbox", "status = 'pending'") == 5
    assert db.count("idem.event_outbox", "status = 'failed'") == 3
    assert db.scalar("SELECT min(last_error) FROM idem.event_outbox WHERE status = 'failed'") == "nacked"

    # a second run finds nothing more
    r = idem(db, servers, "retain", "--batch", "10")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (0, 0), "consumed_events": (0, 0)}
    assert outbox_ids(db) == keep


def test_batches_count_only_deletes_that_removed_rows(db, servers):
    """30 rows with --batch 10: three full DELETEs, then one that removes nothing (not counted)."""
    add_outbox(db, 30, "sent", sent_ago="8 days")
    add_ledger(db, 10, "31 days 1 hour")
    r = idem(db, servers, "retain", "--batch", "10")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (30, 3), "consumed_events": (10, 1)}
    assert db.count("idem.event_outbox") == 0
    assert db.count("idem.consumed_events") == 0


def test_default_windows_and_batch(db, servers):
    """Defaults: outbox 7d by sent_at, ledger 30d by consumed_at plus the day of future timestamps
    a consumer accepts (31d), batch 5000."""
    add_outbox(db, 2, "sent", sent_ago="7 days 1 hour")
    kept = add_outbox(db, 2, "sent", sent_ago="6 days 23 hours")
    add_ledger(db, 3, "31 days 1 hour")
    kept_ledger = add_ledger(db, 2, "30 days 23 hours")
    add_ledger(db, 5001, "45 days", consumer="bulk")
    r = idem(db, servers, "retain")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (2, 1), "consumed_events": (5004, 2)}
    assert outbox_ids(db) == kept
    assert ledger_ids(db) == kept_ledger


def test_custom_windows(db, servers):
    add_outbox(db, 3, "sent", sent_ago="3 hours")
    kept = add_outbox(db, 2, "sent", sent_ago="1 hour")
    add_ledger(db, 4, "3 days 1 hour")  # past 2d plus the day of future timestamps
    kept_ledger = add_ledger(db, 1, "2 days 23 hours")
    r = idem(db, servers, "retain", "--outbox-keep", "2h", "--dedup-window", "2d")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (3, 1), "consumed_events": (4, 1)}
    assert outbox_ids(db) == kept
    assert ledger_ids(db) == kept_ledger


def test_skipped_while_another_run_holds_the_lock(db, servers):
    add_outbox(db, 5, "sent", sent_ago="8 days")
    add_ledger(db, 5, "32 days")
    other = psycopg2.connect(db.url, application_name="nightly-report")
    try:
        other.autocommit = True
        with other.cursor() as cur:
            # "another retention run": its backend holds the lease
            cur.execute("UPDATE idem.idem_leases SET pid = pg_backend_pid(), server_start = "
                        "pg_postmaster_start_time() WHERE name = 'retain'")
            cur.execute("SELECT pg_backend_pid(), current_user")
            pid, role = cur.fetchone()
        r = idem(db, servers, "retain")
        assert r.returncode == 0, r.stderr
        assert r.stdout == "skipped: another retention run is active\n"
        # the operator learns who holds it (another role taking idem's lock by mistake, say)
        assert (f"held by pid {pid}, role {role}, application nightly-report"
                in r.stderr), r.stderr
        assert db.count("idem.event_outbox") == 5
        assert db.count("idem.consumed_events") == 5
    finally:
        other.close()  # ends the session: the lease goes with it
    r = idem(db, servers, "retain")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (5, 1), "consumed_events": (5, 1)}


def test_lock_is_released_after_a_run(db, servers):
    """A finished run leaves the lock free (the next run is not skipped)."""
    for _ in range(2):
        r = idem(db, servers, "retain")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("event_outbox: deleted 0 rows")
    assert db.query("SELECT pid FROM idem.idem_leases WHERE name = 'retain'") == [(None,)]


def test_two_concurrent_runs_do_not_overlap(db, servers):
    """Two runs started together on a big ledger: one is skipped, or they ran one after the
    other; either way every old row is deleted once and the totals add up exactly."""
    n = 200_000
    add_ledger(db, n, "40 days")
    add_outbox(db, 2_000, "sent", sent_ago="10 days")
    results = [None, None]
    env = dict(IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url)

    def run(i):
        results[i] = subprocess.run([IDEM, "retain", "--batch", "500"], capture_output=True,
                                    text=True, timeout=300, env=env)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert r.returncode == 0, r.stderr
    parsed = [parse_retain(r.stdout) for r in results]
    done = [p for p in parsed if p != "skipped"]
    assert done, "both runs were skipped"
    assert sum(p["consumed_events"][0] for p in done) == n
    assert sum(p["event_outbox"][0] for p in done) == 2_000
    if len(done) == 2:  # no overlap: the later run found nothing left
        assert min(p["consumed_events"][0] for p in done) == 0
    assert db.count("idem.consumed_events") == 0
    assert db.count("idem.event_outbox") == 0


def test_window_rule_refused_without_force(db, servers):
    add_outbox(db, 3, "sent", sent_ago="8 days")
    add_ledger(db, 3, "37 hours")  # past 12h plus the day of future timestamps, not past 1d + 1d
    for args in (["--dedup-window", "3d"],                        # shorter than outbox 7d
                 ["--dedup-window", "12h", "--outbox-keep", "1h"],  # shorter than 1d
                 ["--dedup-window", "6d", "--outbox-keep", "8d"],
                 ["--dedup-window", "23h", "--outbox-keep", "1h"]):
        r = idem(db, servers, "retain", *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        line = stderr_line(r)
        assert line.startswith("idem retain: "), line
        assert "--force" in line and "dedup window" in line, line
        assert r.stdout == ""
    assert db.count("idem.event_outbox") == 3
    assert db.count("idem.consumed_events") == 3

    # equal windows, and exactly 1d, are allowed
    r = idem(db, servers, "retain", "--dedup-window", "1d", "--outbox-keep", "1d")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (3, 1), "consumed_events": (0, 0)}

    r = idem(db, servers, "retain", "--dedup-window", "12h", "--outbox-keep", "1h", "--force")
    assert r.returncode == 0, r.stderr
    assert parse_retain(r.stdout) == {"event_outbox": (0, 0), "consumed_events": (3, 1)}
    assert db.count("idem.consumed_events") == 0


def test_sigterm_stops_between_batches(db, servers):
    """SIGTERM mid-run: the batches done stay done, the run reports them and exits 0."""
    n = 150_000
    add_ledger(db, n, "40 days")
    proc = subprocess.Popen([IDEM, "retain", "--batch", "100"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url))
    try:
        wait_until(lambda: db.count("idem.consumed_events") < n, 30, 0.02, "retention to start")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    parsed = parse_retain(out)
    left = db.count("idem.consumed_events")
    rows, batches = parsed["consumed_events"]
    assert rows + left == n
    if left:  # the signal arrived before the last batch (the usual case)
        assert rows % 100 == 0 and batches == rows // 100
        assert "interrupted" in err
        time.sleep(0.1)
        r = idem(db, servers, "retain", "--batch", "5000")  # a later run finishes the job
        assert r.returncode == 0, r.stderr
        assert parse_retain(r.stdout)["consumed_events"][0] == left
    assert db.count("idem.consumed_events") == 0
