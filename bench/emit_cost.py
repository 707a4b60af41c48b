#!/usr/bin/env python3
"""Where an emit's cost goes: idem_emit taken apart step by step, each step measured against the
plain insert of the same row into a table of the outbox's shape and indexes.

Each variant is a pgbench script run one event a transaction. For each it prints the WAL written
per event (records and bytes, from pg_stat_wal: the same on any machine for the same server
version and data, so it does not depend on load), the mean latency of one connection with
synchronous_commit off (the CPU cost, no flush in it), and, unless --no-durable, the throughput
of --conns connections with durable commits (what the application sees).

Variants, each one step less than the one before:
  idem_emit        the function as migrated: SECURITY DEFINER, pinned search_path, the dedup key
                   check, then idem_emit_event (pinned search_path too)
  emit_event       idem_emit_event called directly (the wrapper's cost is the difference)
  no_probes        a new row returns at once: no look for an older row or key of its id, no
                   idle-relay check
  no_lock          also without the subscription's order-lock row
  no_checks        also without the argument checks
  plpgsql_insert   the outbox insert alone inside a plpgsql SECURITY DEFINER function with a
                   pinned search_path
  plain            INSERT INTO a plain table (LIKE idem.event_outbox INCLUDING ALL)

Usage (a migrated database in IDEM_PG_URL, e.g. under scripts/services.sh with --durable):
  bench/emit_cost.py [--seconds 10] [--conns 16] [--no-durable]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = "bench_emit_cost"

PAYLOAD = ("jsonb_build_object('invoice_id', gen_random_uuid(), 'subscription_id', "
           "md5('bench-sub-' || (:id::bigint % 500))::uuid, 'amount_cents', 4999, 'currency', 'EUR', "
           "'reason', 'card_declined')")
SUB = "md5('bench-sub-' || (:id::bigint % 500))::uuid"


def psql(sql, url):
    r = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-d", url, "-c", sql],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"emit_cost: psql failed: {r.stderr.strip()}")
    return r.stdout.strip()


def emit_body():
    """idem.idem_emit_event's definition (the body idem_emit and idem_emit_followup run) as the
    database has it now."""
    return psql("SELECT pg_catalog.pg_get_functiondef('idem.idem_emit_event(text,uuid,text,jsonb,"
                "jsonb)'::regprocedure)", URL)


def strip(src, start, end):
    """src without the part from the line matching start to the line matching end (inclusive)."""
    lines, out, skip = src.split("\n"), [], False
    for ln in lines:
        if not skip and re.search(start, ln):
            skip = True
        if not skip:
            out.append(ln)
        elif re.search(end, ln):
            skip = False
    return "\n".join(out)


def variants():
    full = emit_body().replace("idem.idem_emit_event(", f"{SCHEMA}.v(", 1)
    full = full.replace("CREATE OR REPLACE FUNCTION", "CREATE FUNCTION", 1)
    steps = [("emit_event", full)]
    # the new-row branch returns at once: no look for an older row or key, no idle-relay check
    no_probes = re.sub(r"    ELSE\n        -- a new row.*?        DELETE FROM event_outbox o WHERE o.outbox_id = v_outbox;\n",
                       "    ELSE\n        RETURN v_event_id;\n", full, flags=re.S)
    steps.append(("no_probes", no_probes))
    no_lock = strip(no_probes, r"v_timeout := current_setting", r"^    END IF;\s*$")
    no_lock = strip(no_lock, r"PERFORM 1 FROM idem_emit_locks", r"^    END IF;\s*$")
    no_lock = strip(no_lock, r"IF v_timeout = '0' THEN", r"^    END IF;\s*$")
    steps.append(("no_lock", no_lock))
    no_checks = no_lock
    for pat in (r"IF subscription_id IS NULL", r"IF event_type IS NULL", r"IF payload IS NULL",
                r"IF headers IS NOT NULL"):
        no_checks = strip(no_checks, pat, r"^    END IF;\s*$")
    steps.append(("no_checks", no_checks))
    for name, src in steps:
        if src.count("CREATE FUNCTION") != 1 or (name != "emit_event" and src == full):
            sys.exit(f"emit_cost: could not derive variant {name} from idem_emit_event's body")
    return steps


def setup():
    psql(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA};"
         f"CREATE TABLE {SCHEMA}.plain (LIKE idem.event_outbox INCLUDING ALL);", URL)
    funcs = {}
    for name, src in variants():
        fn = src.replace(f"{SCHEMA}.v(", f"{SCHEMA}.{name}(", 1).replace("idem_emit_event.",
                                                                         f"{name}.")
        psql(fn, URL)
        funcs[name] = f"{SCHEMA}.{name}"
    psql(f"""CREATE FUNCTION {SCHEMA}.plpgsql_insert(event_type text, subscription_id uuid,
             dedup_key text, payload jsonb, headers jsonb DEFAULT NULL) RETURNS uuid
             LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, idem, pg_temp AS $$
             DECLARE v uuid := md5(dedup_key)::uuid;
             BEGIN
               INSERT INTO event_outbox (event_id, subscription_id, event_type, payload, headers)
               VALUES (v, plpgsql_insert.subscription_id, plpgsql_insert.event_type,
                       plpgsql_insert.payload, plpgsql_insert.headers)
               ON CONFLICT ON CONSTRAINT event_outbox_event_id_key DO NOTHING;
               RETURN v;
             END $$""", URL)
    funcs["plpgsql_insert"] = f"{SCHEMA}.plpgsql_insert"
    return funcs


def script(kind, fn, n, tag, tmp):
    """A psql script: PREPARE the variant's statement, EXECUTE it n times (one autocommit
    transaction each, synchronous_commit off), reading the backend's CPU time (ns, from
    /proc/PID/schedstat) before and after into tmp/TAG.0 and tmp/TAG.1."""
    pay = PAYLOAD.replace(":id", "$1")
    sub = SUB.replace(":id", "$1")
    if kind == "plain":
        stmt = (f"INSERT INTO {SCHEMA}.plain (event_id, subscription_id, event_type, payload) "
                f"VALUES (md5('{tag}-' || $1)::uuid, {sub}, 'payment.failed', {pay})")
    else:
        stmt = f"SELECT {fn}('payment.failed', {sub}, '{tag}-' || $1, {pay}, NULL::jsonb)"
    out = [f"PREPARE p(bigint) AS {stmt};", "SET synchronous_commit = off;",
           "SELECT pg_backend_pid() AS pid \\gset", "\\setenv BPID :pid",
           f"\\! cut -d' ' -f1 /proc/$BPID/schedstat > {tmp}/{tag}.0"]
    out += [f"EXECUTE p({i});" for i in range(n)]
    out.append(f"\\! cut -d' ' -f1 /proc/$BPID/schedstat > {tmp}/{tag}.1")
    return "\n".join(out) + "\n"


def reset():
    psql(f"TRUNCATE idem.event_outbox, idem.idem_emitted_keys, {SCHEMA}.plain; CHECKPOINT", URL)


def wal():
    return json.loads(psql("SELECT json_build_object('r', wal_records, 'b', wal_bytes, "
                           "'f', wal_fpi) FROM pg_stat_wal", URL))


def cpu_run(kind, fn, n, tag, tmp):
    """n events of the variant on one connection: (backend CPU us per event, WAL records and
    bytes per event)."""
    path = os.path.join(tmp, f"{tag}.sql")
    with open(path, "w") as f:
        f.write(script(kind, fn, n, tag, tmp))
    w0 = wal()
    r = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-o", "/dev/null", "-d", URL,
                        "-f", path], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"emit_cost: {kind} failed: {r.stderr.strip()[-400:]}")
    w1 = wal()
    ns = [int(open(os.path.join(tmp, f"{tag}.{k}")).read()) for k in (0, 1)]
    return (ns[1] - ns[0]) / 1000.0 / n, (w1["r"] - w0["r"]) / n, (w1["b"] - w0["b"]) / n


def pgbench(kind, fn, conns, seconds, tmp):
    """Durable commits on conns connections for seconds: events/s."""
    path = os.path.join(tmp, f"{kind}.bench.sql")
    head = "\\set id random(1, 1000000000000000)\n"
    if kind == "plain":
        body = (f"INSERT INTO {SCHEMA}.plain (event_id, subscription_id, event_type, payload) "
                f"VALUES (md5('k-' || :id)::uuid, {SUB}, 'payment.failed', {PAYLOAD});\n")
    else:
        body = f"SELECT {fn}('payment.failed', {SUB}, 'k-' || :id, {PAYLOAD}, NULL::jsonb);\n"
    with open(path, "w") as f:
        f.write(head + body)
    r = subprocess.run(["pgbench", "-n", "-M", "prepared", "-c", str(conns), "-j",
                        str(min(conns, 4)), "-T", str(seconds), "-f", path, URL],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"emit_cost: pgbench failed: {r.stderr.strip()[-400:]}")
    return float(re.search(r"tps = ([0-9.]+)", r.stdout).group(1))


def main():
    global URL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--durable", action="store_true",
                    help="also pgbench --conns connections with durable commits (quiet machine)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    URL = os.environ.get("IDEM_PG_URL", "")
    funcs = setup()
    order = ["idem_emit", "emit_event", "no_probes", "no_lock", "no_checks", "plpgsql_insert",
             "plain"]
    funcs["idem_emit"] = "idem.idem_emit"
    res = {k: {"wal_records": [], "wal_bytes": [], "cpu_us": [], "tps": []} for k in order}
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        for rnd in range(a.rounds):
            for k in order:
                reset()
                cpu, rec, byt = cpu_run(k, funcs.get(k), a.events, f"{k}-{rnd}", tmp)
                res[k]["cpu_us"].append(cpu)
                res[k]["wal_records"].append(rec)
                res[k]["wal_bytes"].append(byt)
                if a.durable:
                    reset()
                    res[k]["tps"].append(pgbench(k, funcs.get(k), a.conns, a.seconds, tmp))
    psql(f"DROP SCHEMA {SCHEMA} CASCADE; TRUNCATE idem.event_outbox, idem.idem_emitted_keys", URL)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    plain_tps = med(res["plain"]["tps"])
    plain_cpu = med(res["plain"]["cpu_us"])
    if a.json:
        print(json.dumps(res))
    hdr = (f"{'variant':<16}{'WAL rec/event':>14}{'WAL B/event':>12}{'CPU us/event':>13}"
           f"{'x plain':>9}")
    if a.durable:
        hdr += f"{f'{a.conns}-conn/s':>12}{'x plain':>9}"
    print(hdr)
    for k in order:
        r = res[k]
        line = (f"{k:<16}{med(r['wal_records']):>14.1f}{med(r['wal_bytes']):>12.0f}"
                f"{med(r['cpu_us']):>13.1f}{med(r['cpu_us']) / plain_cpu:>9.2f}")
        if a.durable:
            line += f"{med(r['tps']):>12.0f}{med(r['tps']) / plain_tps:>9.2f}"
        print(line)


if __name__ == "__main__":
    main()
