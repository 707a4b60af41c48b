#!/usr/bin/python3
"""loadgen.py - load drivers for `make bench` (Debian's /usr/bin/python3 + python3-psycopg2).

  loadgen.py dblimit   --events N [--per-tx 100] [--consumer bench-db]
      the database limit for a consumer: a set-based statement claims 100 events in the dedup
      ledger and applies their dunning effect, one durable commit per 100 events.
  loadgen.py emit-rate --rate R --seconds S --run NAME [--conns 4]
      emits payment.failed events through idem_emit, one per transaction, at a steady R/s.
  loadgen.py emit-idle --count N --gap-ms G --run NAME
      emits one event at a time, G ms apart.

Each prints one JSON line. The connection comes from IDEM_PG_URL. Events go round-robin over
SUBSCRIPTIONS (500 fixed ids shared with bench.py); their payload carries "bench_run": NAME so
that bench.py can find a run's events.
"""
import argparse
import json
import os
import threading
import time
import uuid

import psycopg2

NS = uuid.UUID("6f1c1f5e-8a55-4c6e-9d59-3b0d1d5e0b11")
SUBSCRIPTIONS = [str(uuid.uuid5(NS, f"bench-sub-{i}")) for i in range(500)]

DBLIMIT_SQL = """
WITH ev AS (
    SELECT * FROM unnest(%s::uuid[], %s::uuid[]) AS e(event_id, subscription_id)
), claimed AS (
    INSERT INTO idem.consumed_events (consumer, event_id)
    SELECT %s, event_id FROM ev
    ON CONFLICT DO NOTHING
    RETURNING event_id
), per_sub AS (
    SELECT ev.subscription_id, count(*)::int AS n, (array_agg(ev.event_id))[1] AS last_event_id
      FROM claimed JOIN ev USING (event_id)
     GROUP BY ev.subscription_id
)
INSERT INTO billing.dunning (subscription_id, step, last_event_id)
SELECT subscription_id, n, last_event_id FROM per_sub
ON CONFLICT (subscription_id) DO UPDATE
   SET step = dunning.step + EXCLUDED.step, updated_at = now(),
       last_event_id = EXCLUDED.last_event_id
"""


def connect():
    return psycopg2.connect(os.environ.get("IDEM_PG_URL", ""))


def payload(sub, run):
    return json.dumps({
        "invoice_id": str(uuid.uuid4()),
        "subscription_id": sub,
        "amount_cents": 4999,
        "currency": "EUR",
        "reason": "card_declined",
        "bench_run": run,
    })


def dblimit(events, per_tx=100, consumer="bench-db", nsubs=500):
    """Applies `events` new events in transactions of per_tx; returns wall-clock figures (the
    rate bench.py reports comes from commit timestamps)."""
    subs = SUBSCRIPTIONS[:nsubs]
    ids = [str(uuid.uuid4()) for _ in range(events)]
    db = connect()
    cur = db.cursor()
    t0 = time.monotonic()
    for start in range(0, events, per_tx):
        chunk = ids[start:start + per_tx]
        chunk_subs = [subs[(start + k) % len(subs)] for k in range(len(chunk))]
        cur.execute(DBLIMIT_SQL, (chunk, chunk_subs, consumer))
        db.commit()  # durable: synchronous_commit is on
    secs = time.monotonic() - t0
    db.close()
    return {"tool": "dblimit", "events": events, "per_tx": per_tx, "seconds": round(secs, 4),
            "wall_rate": round(events / secs, 1) if secs > 0 else 0.0}


EMIT_SQL = "SELECT idem.idem_emit('payment.failed', %s::uuid, %s, %s::jsonb)"


def emit_rate(rate, seconds, run, conns=4):
    """Paced emitter: `conns` connections each emit one event per transaction (autocommit) on a
    fixed schedule; together `rate` events/s for `seconds`. Late events go out at once (the
    schedule is not stretched), and the worst lateness is reported."""
    total = int(rate * seconds)
    stats = {"emitted": 0, "max_late_ms": 0.0, "late_over_5ms": 0}
    lock = threading.Lock()
    t0 = time.monotonic() + 0.05

    def worker(w):
        db = connect()
        db.autocommit = True
        cur = db.cursor()
        n = late5 = 0
        max_late = 0.0
        for i in range(w, total, conns):
            due = t0 + i / rate
            d = due - time.monotonic()
            if d > 0:
                time.sleep(d)
            else:
                max_late = max(max_late, -d * 1000)
                late5 += -d > 0.005
            sub = SUBSCRIPTIONS[i % len(SUBSCRIPTIONS)]
            cur.execute(EMIT_SQL, (sub, f"{run}-{i}", payload(sub, run)))
            n += 1
        db.close()
        with lock:
            stats["emitted"] += n
            stats["max_late_ms"] = max(stats["max_late_ms"], round(max_late, 2))
            stats["late_over_5ms"] += late5

    errors = []

    def guarded(w):
        try:
            worker(w)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    secs = time.monotonic() - t0
    stats.update({"tool": "emit-rate", "run": run, "target_rate": rate,
                  "seconds": round(secs, 4), "achieved_rate": round(stats["emitted"] / secs, 1)})
    return stats


def emit_idle(count, gap_ms, run):
    db = connect()
    db.autocommit = True
    cur = db.cursor()
    t0 = time.monotonic()
    for i in range(count):
        sub = SUBSCRIPTIONS[i % len(SUBSCRIPTIONS)]
        cur.execute(EMIT_SQL, (sub, f"{run}-{i}", payload(sub, run)))
        time.sleep(gap_ms / 1000.0)
    db.close()
    return {"tool": "emit-idle", "run": run, "emitted": count, "gap_ms": gap_ms,
            "seconds": round(time.monotonic() - t0, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dblimit")
    d.add_argument("--events", type=int, default=100000)
    d.add_argument("--per-tx", type=int, default=100)
    d.add_argument("--consumer", default="bench-db")
    d.add_argument("--subscriptions", type=int, default=500)
    r = sub.add_parser("emit-rate")
    r.add_argument("--rate", type=float, default=1000.0)
    r.add_argument("--seconds", type=float, default=5.0)
    r.add_argument("--run", required=True)
    r.add_argument("--conns", type=int, default=4)
    i = sub.add_parser("emit-idle")
    i.add_argument("--count", type=int, default=40)
    i.add_argument("--gap-ms", type=float, default=150.0)
    i.add_argument("--run", required=True)
    a = ap.parse_args()
    if a.cmd == "dblimit":
        out = dblimit(a.events, a.per_tx, a.consumer, a.subscriptions)
    elif a.cmd == "emit-rate":
        out = emit_rate(a.rate, a.seconds, a.run, a.conns)
    else:
        out = emit_idle(a.count, a.gap_ms, a.run)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
