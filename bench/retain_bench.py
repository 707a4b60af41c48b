#!/usr/bin/python3
"""Retention under load: how fast `idem retain` empties an old ledger, and how long concurrent
consumer-like transactions wait meanwhile.

  bench/retain_bench.py [--rows N] [--recent N] [--batch N] [--keep-dir] [--svc-dir DIR]

Starts private durable servers (scripts/services.sh start DIR --durable; fsync on, like
production), migrates, builds a ledger of N rows (default 1,000,000) older than the 30d dedup
window plus --recent rows inside it, then runs `build/idem retain` while a loop of consumer-like
transactions (INSERT INTO idem.consumed_events ... ON CONFLICT DO NOTHING; COMMIT) runs beside it and
times each. Half of those inserts hit keys of old rows the retention is deleting (a late
redelivery), so they can meet a row lock of a DELETE batch. Prints rows deleted per second and
the longest time one concurrent transaction took, against a baseline measured before the run.
Stops the servers at the end. IDEM_BIN overrides the binary (default build/idem).
"""
import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psycopg2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDEM = os.environ.get("IDEM_BIN") or os.path.join(ROOT, "build", "idem")
SERVICES = os.path.join(ROOT, "scripts", "services.sh")


def load_env(path):
    env = {}
    with open(path) as f:
        for word in f.read().split():
            if "=" in word:
                k, v = word.split("=", 1)
                env[k] = v
    return env


class Loop(threading.Thread):
    """Consumer-like transactions in a loop; records each one's duration in seconds."""

    def __init__(self, dsn, old_rows, pause_s):
        super().__init__(daemon=True)
        self.conn = psycopg2.connect(dsn)
        self.old_rows = old_rows
        self.pause_s = pause_s
        self.durations = []
        self.stop = threading.Event()
        self.error = None

    def run(self):
        cur = self.conn.cursor()
        rnd = random.Random(7)
        try:
            while not self.stop.is_set():
                if rnd.random() < 0.5:
                    # a late redelivery of an old event: its ledger row may be in a DELETE batch
                    g = rnd.randint(1, self.old_rows)
                    sql = ("INSERT INTO idem.consumed_events (consumer, event_id) "
                           "VALUES ('bench-' || (%s %% 4), md5(%s::text)::uuid) "
                           "ON CONFLICT DO NOTHING")
                    args = (g, g)
                else:
                    sql = ("INSERT INTO idem.consumed_events (consumer, event_id) "
                           "VALUES ('bench-live', gen_random_uuid()) ON CONFLICT DO NOTHING")
                    args = None
                t0 = time.monotonic()
                cur.execute(sql, args)
                self.conn.commit()
                self.durations.append(time.monotonic() - t0)
                if self.pause_s:
                    time.sleep(self.pause_s)
        except Exception as e:  # reported by the main thread
            self.error = e
        finally:
            self.conn.close()


def summary(d):
    if not d:
        return "no transactions"
    q = statistics.quantiles(d, n=100) if len(d) >= 2 else [d[0]] * 99
    return (f"{len(d)} txns, p50 {q[49] * 1000:.2f} ms, p99 {q[98] * 1000:.2f} ms, "
            f"max {max(d) * 1000:.2f} ms")


def measure(dsn, old_rows, pause_s, seconds=None, during=None):
    loop = Loop(dsn, old_rows, pause_s)
    loop.start()
    result = None
    if during is not None:
        result = during()
    else:
        time.sleep(seconds)
    loop.stop.set()
    loop.join(30)
    if loop.error is not None:
        raise SystemExit(f"retain_bench: concurrent loop failed: {loop.error}")
    return loop.durations, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="old ledger rows (default 1e6)")
    ap.add_argument("--recent", type=int, default=50_000, help="ledger rows inside the window")
    ap.add_argument("--batch", type=int, default=5000, help="idem retain --batch (default 5000)")
    ap.add_argument("--pause-ms", type=float, default=1.0,
                    help="pause between concurrent transactions (default 1 ms)")
    ap.add_argument("--svc-dir", help="services directory (default: a fresh temporary one)")
    ap.add_argument("--keep-dir", action="store_true", help="keep the services directory")
    args = ap.parse_args()

    if not os.access(IDEM, os.X_OK):
        raise SystemExit(f"retain_bench: {IDEM} not built (run make)")
    svc = args.svc_dir or tempfile.mkdtemp(prefix="idem-retain-bench.", dir="/tmp")
    os.chmod(svc, 0o755)
    print(f"retain_bench: starting durable servers in {svc}", flush=True)
    envfile = subprocess.run([SERVICES, "start", svc, "--durable"], check=True,
                             stdout=subprocess.PIPE, text=True).stdout.strip()
    try:
        run(args, load_env(envfile))
    finally:
        subprocess.run([SERVICES, "stop", svc], check=False)
        if not args.keep_dir and not args.svc_dir:
            subprocess.run(["rm", "-rf", "--", svc], check=False)


def run(args, env):
    dsn = env["IDEM_PG_URL"]
    cenv = dict(os.environ, IDEM_PG_URL=dsn, IDEM_AMQP_URL=env["IDEM_AMQP_URL"])
    subprocess.run([IDEM, "migrate", "--billing", "--sql-dir", os.path.join(ROOT, "sql")], env=cenv, check=True, stdout=subprocess.DEVNULL)

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("SHOW fsync")
    fsync = cur.fetchone()[0]
    cur.execute("TRUNCATE idem.consumed_events")
    t0 = time.monotonic()
    # old rows: 40 days and more, one second apart; keys md5(g) so the loop can hit them
    cur.execute("INSERT INTO idem.consumed_events (consumer, event_id, consumed_at) "
                "SELECT 'bench-' || (g %% 4), md5(g::text)::uuid, "
                "now() - interval '40 days' - g * interval '1 second' "
                "FROM generate_series(1, %s) g", (args.rows,))
    cur.execute("INSERT INTO idem.consumed_events (consumer, event_id, consumed_at) "
                "SELECT 'bench-recent', gen_random_uuid(), now() - g * interval '1 second' "
                "FROM generate_series(1, %s) g", (args.recent,))
    cur.execute("VACUUM ANALYZE idem.consumed_events")
    print(f"retain_bench: built {args.rows} old + {args.recent} recent ledger rows in "
          f"{time.monotonic() - t0:.1f} s (fsync={fsync})", flush=True)

    base, _ = measure(dsn, args.rows, args.pause_ms / 1000.0, seconds=3.0)

    def retain():
        t = time.monotonic()
        p = subprocess.run([IDEM, "retain", "--batch", str(args.batch)], env=cenv,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return p, time.monotonic() - t

    during, (proc, elapsed) = measure(dsn, args.rows, args.pause_ms / 1000.0, during=retain)
    if proc.returncode != 0:
        raise SystemExit(f"retain_bench: idem retain exited {proc.returncode}: {proc.stderr}")
    m = re.search(r"^consumed_events: deleted (\d+) rows in (\d+) batches$", proc.stdout, re.M)
    if m is None:
        raise SystemExit(f"retain_bench: unexpected output: {proc.stdout!r}")
    deleted, batches = int(m.group(1)), int(m.group(2))

    cur.execute("SELECT count(*) FILTER (WHERE consumed_at < now() - interval '30 days'), "
                "count(*) FILTER (WHERE consumer = 'bench-recent') FROM idem.consumed_events")
    old_left, recent_left = cur.fetchone()
    conn.close()

    print(proc.stdout.strip())
    print(f"retain_bench: deleted {deleted} ledger rows in {batches} batches of <= {args.batch} "
          f"in {elapsed:.2f} s = {deleted / elapsed:,.0f} rows/s")
    print(f"retain_bench: left {old_left} rows older than the window, "
          f"{recent_left}/{args.recent} recent rows kept")
    print(f"retain_bench: concurrent txns before retain: {summary(base)}")
    print(f"retain_bench: concurrent txns during retain: {summary(during)}")
    if during:
        print(f"retain_bench: longest concurrent transaction during retain: "
              f"{max(during) * 1000:.1f} ms")
    if deleted != args.rows or old_left != 0 or recent_left != args.recent:
        print("retain_bench: FAILED: unexpected row counts", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
