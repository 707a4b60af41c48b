"""Several chaos runs one after another (`make chaos-all`): each seed in each topology, each run
its own scripts/chaos.py process (one at a time), then one table of the results, built from the
summary file each run writes (--summary)."""

import json
import os
import subprocess
import sys
import tempfile
import time

# Flags of the matrix itself, with their values, left out of the runs' command lines.
OWN_FLAGS = ("--seeds", "--topologies", "--topology", "--summary", "--seed")


def run_flags(argv):
    """argv without the matrix's own flags (each run gets its seed and topology)."""
    out, words = [], iter(argv)
    for w in words:
        if w in OWN_FLAGS:
            next(words, None)
        elif not w.startswith(tuple(f + "=" for f in OWN_FLAGS)):
            out.append(w)
    return out


def parse_seeds(text):
    seeds = [int(w) for w in text.replace(",", " ").split()]
    if not seeds:
        raise ValueError("no seed")
    return seeds


def run_all(chaos_py, seeds, topologies, argv):
    rows = []
    flags = run_flags(argv)
    tmp = tempfile.mkdtemp(prefix="idem-chaos-matrix.")
    for seed in seeds:
        for topo in topologies:
            path = os.path.join(tmp, f"{topo}-{seed}.json")
            cmd = [sys.executable, chaos_py, "--seed", str(seed), "--topology", topo,
                   "--summary", path, *flags]
            print(f"==== chaos run: topology {topo}, seed {seed}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.monotonic()
            rc = subprocess.call(cmd)
            try:
                with open(path) as f:
                    row = json.load(f)
            except (OSError, ValueError):
                row = {"seed": seed, "topology": topo, "ok": False, "lines": [],
                       "error": f"exit {rc} without a summary"}
            row["exit"] = rc
            row["wall_s"] = time.monotonic() - t0
            rows.append(row)
            print(flush=True)
    print_table(rows)
    with open(os.path.join(tmp, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\nsummaries in {tmp}")
    return 0 if rows and all(r["ok"] and r["exit"] == 0 for r in rows) else 1


def cell_drain(r):
    d = r.get("drain_s")
    return "-" if d is None else f"{d:.1f} s"


def print_table(rows):
    head = ("topology", "seed", "events", "faults", "missing", "doubled", "out of order", "drain",
            "backlog at rmq stop", "audit")
    table = []
    for r in rows:
        failed = [ln["what"].split(":")[0] for ln in r.get("lines", []) if not ln["ok"]]
        verdict = "PASS" if r["ok"] and r["exit"] == 0 else "FAIL" + (
            ": " + ", ".join(failed) if failed else f": {r.get('error', 'exit %d' % r['exit'])}")
        c = r.get("counts", {})
        table.append((r["topology"], str(r["seed"]), str(r.get("events", "-")),
                      str(sum(r.get("faults", {}).values())), str(c.get("missing", "-")),
                      str(c.get("doubled", "-")), str(c.get("out_of_order", "-")), cell_drain(r),
                      ", ".join(str(b) for b in r.get("rmq_backlog", [])) or "-", verdict))
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    print("Chaos runs")
    print(fmt(head))
    print(fmt(["-" * w for w in widths]))
    for t in table:
        print(fmt(t))
    print("\nFaults by kind")
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.get("faults", {}).items()))
        print(f"  {r['topology']:<12} seed {r['seed']:<6} {kinds or '-'}")
    bad = [r for r in rows if not (r["ok"] and r["exit"] == 0)]
    for r in bad:
        print(f"\nFAIL {r['topology']} seed {r['seed']} (logs: {r.get('logs', '-')})")
        for ln in r.get("lines", []):
            if not ln["ok"]:
                print(f"  FAIL  {ln['what']}\n        {ln['figures']}")
