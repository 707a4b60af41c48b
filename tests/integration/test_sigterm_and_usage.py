"""SIGTERM stops a consumer cleanly (finish and commit what is in hand, ack it, exit 0); a second
signal exits at once. Usage errors exit 2 with one line on stderr."""

import signal
import time

import pytest

from conftest import payload, run_idem, wait_until

LOCKED = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
          "AND wait_event_type = 'Lock'")


def test_sigterm_idle_exits_0(db, queue, consumers):
    c = consumers("billing", queue, db)
    t0 = time.monotonic()
    assert c.stop(timeout=10) == 0
    assert time.monotonic() - t0 < 5


def test_sigterm_finishes_and_acks_delivery_in_hand(servers, db, queue, consumers, broker):
    c = consumers("billing", queue, db)
    body = payload()
    with db.connect(autocommit=False) as blocker:
        with blocker.cursor() as cur:
            cur.execute("LOCK TABLE billing.dunning IN SHARE MODE")
        eid = broker.publish_event("payment.failed", body)
        wait_until(lambda: db.scalar(LOCKED) >= 1, 10, 0.05, "the consumer blocked on the lock")
        c.signal(signal.SIGTERM)  # once
        time.sleep(0.3)
        assert c.running(), "exited with a delivery in hand"
        blocker.commit()
    assert c.wait_exit(10) == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert db.ledger() == [("billing", eid)]
    # Acked before exiting: nothing comes back to a later consumer.
    assert broker.queue_info(queue) == (0, 0)


def test_second_signal_exits_at_once(db, queue, consumers, broker):
    c = consumers("billing", queue, db)
    body = payload()
    with db.connect(autocommit=False) as blocker:
        with blocker.cursor() as cur:
            cur.execute("LOCK TABLE billing.dunning IN SHARE MODE")
        broker.publish_event("payment.failed", body)
        wait_until(lambda: db.scalar(LOCKED) >= 1, 10, 0.05, "the consumer blocked on the lock")
        c.signal(signal.SIGTERM)
        time.sleep(0.3)
        c.signal(signal.SIGTERM)
        c.wait_exit(5)  # while the lock is still held
        blocker.rollback()
    # Never acked, so the message is back in the queue (whether or not the server went on to
    # commit a transaction the client had already sent); the next consumer settles it, once.
    wait_until(lambda: db.scalar(LOCKED) == 0, 10, 0.05, "the abandoned transaction gone")
    wait_until(lambda: broker.queue_info(queue) == (1, 0), 10, 0.1, "the message back in the queue")

    c2 = consumers("billing", queue, db)
    c2.wait_handled(1)
    assert c2.stop() == 0
    assert db.dunning_step(body["subscription_id"]) == 1
    assert len(db.ledger()) == 1
    assert broker.queue_info(queue) == (0, 0)


@pytest.mark.parametrize("args", [
    ["--bogus"],
    ["--consumer", "c", "--queue", "q", "--bogus"],
    ["--consumer", "c", "--queue", "q", "--dedup-window", "30"],
    ["--consumer", "c", "--queue", "q", "--dedup-window", "30x"],
    ["--consumer", "c", "--queue", "q", "--prefetch", "many"],
    ["--consumer", "c", "--queue", "q", "--max-retries", "-1"],
    ["--consumer", "c", "--queue", "q", "--max-message-bytes", "1k"],
])
def test_usage_errors_exit_2_with_one_line(args):
    # Unreachable servers on purpose: a usage error is reported before connecting.
    r = run_idem("consume", *args, pg_url="postgresql://postgres@127.0.0.1:1/none",
                 amqp_url="amqp://guest:guest@127.0.0.1:1", timeout=10)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("missing", ["--consumer", "--queue"])
def test_missing_required_flag_is_a_usage_error(missing):
    args = {"--consumer": "c", "--queue": "q"}
    del args[missing]
    flat = [x for kv in args.items() for x in kv]
    r = run_idem("consume", *flat, pg_url="postgresql://postgres@127.0.0.1:1/none",
                 amqp_url="amqp://guest:guest@127.0.0.1:1", timeout=10)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip() != ""


def test_consume_help_lists_flags_with_defaults():
    r = run_idem("consume", "--help", timeout=10)
    assert r.returncode == 0
    out = r.stdout + r.stderr
    for flag, default in [("--prefetch", "200"), ("--dedup-window", "30d"),
                          ("--max-message-bytes", "1048576"), ("--max-retries", "5"),
                          ("--consumer", None), ("--queue", None), ("--bind", None),
                          ("--metrics-port", None)]:
        assert flag in out
        if default:
            line = next(line for line in out.splitlines() if line.strip().startswith(flag))
            assert default in line, line
