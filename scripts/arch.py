#!/usr/bin/env python3
"""The architecture as the code has it: which module includes which, checked against the layers.

A module is a group of files under src/ (and handlers/) sharing a name: `consumer` is
consumer.c, consumer_inbox.c, ..., consumer_int.h; `pg` is pg.c, pg_pipeline.c, pg_where.c,
pg_array.c, pg.h, pg_int.h; and so on. An edge A -> B means a file of A includes a header of B.

Checks (exit 1 if one fails):
- no cycle between modules;
- only the adapters include the client libraries: <amqp*.h> in rmq only, <libpq-fe.h> in pg
  (and in the public headers, whose API takes a PGconn), and no other module calls PQ* or
  amqp_* functions; OpenSSL's headers only in rmq (the shard hash) and digest (the ledger's
  content digest);
- every module's edges go to a lower layer or its own (core -> adapters -> utilities, never up).

`scripts/arch.py` prints the module graph by layer; `--dot` prints it for Graphviz.
"""

import collections
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# From the top: the commands, the runtimes, what handlers see, the adapters, the message format
# they map to, the utilities.
LAYERS = [
    ("cli", ["cli", "handlers"]),
    ("runtime", ["consumer", "relay", "outbox", "migrate", "retain", "status", "replay", "dlq",
                 "console"]),
    ("handler API", ["event", "registry", "policy"]),
    ("adapters", ["pg", "rmq", "metrics"]),
    ("wire format", ["envelope", "digest"]),
    ("utilities", ["error", "log", "mask", "duration", "backoff", "clock", "uuid", "fault",
                   "host", "notify"]),
]
ADAPTER_LIBS = {"pg": re.compile(r"#include <libpq-fe\.h>"),
                "rmq": re.compile(r"#include <amqp[a-z_]*\.h>")}
# OpenSSL's hashes: the shard function (rmq) and the ledger's content digest (digest).
OPENSSL = re.compile(r"#include <openssl/")
OPENSSL_MODULES = {"rmq", "digest"}
CALLS = {"pg": re.compile(r"\bPQ[a-zA-Z]+\("), "rmq": re.compile(r"\bamqp_[a-z_]+\(")}


def module_of(path):
    rel = os.path.relpath(path, ROOT)
    if rel.startswith("src/cli/"):
        return "cli"
    if rel.startswith("handlers/"):
        return "handlers"
    base = os.path.basename(rel).rsplit(".", 1)[0]
    if base == "metrics_http":
        return "metrics"
    return base.split("_")[0]


def sources():
    files = (glob.glob(os.path.join(ROOT, "src", "**", "*.[ch]"), recursive=True)
             + glob.glob(os.path.join(ROOT, "handlers", "*.[ch]")))
    return sorted(files)


def main():
    layer_of = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}
    headers = {}
    for f in sources():
        if f.endswith(".h"):
            headers[os.path.basename(f)] = module_of(f)
    edges = collections.defaultdict(set)
    problems = []
    for f in sources():
        m = module_of(f)
        if m not in layer_of:
            problems.append(f"{os.path.relpath(f, ROOT)}: module '{m}' is in no layer")
            continue
        text = open(f, encoding="utf-8").read()
        for inc in re.findall(r'#include "([^"]+)"', text):
            target = headers.get(os.path.basename(inc))
            if target is not None and target != m:
                edges[m].add(target)
        for lib, pat in ADAPTER_LIBS.items():
            if m != lib and pat.search(text):
                problems.append(f"{os.path.relpath(f, ROOT)}: includes {lib}'s client library")
        if m not in OPENSSL_MODULES and OPENSSL.search(text):
            problems.append(f"{os.path.relpath(f, ROOT)}: includes OpenSSL (only "
                            f"{', '.join(sorted(OPENSSL_MODULES))} may)")
        for lib, pat in CALLS.items():
            if m != lib and pat.search(text):
                problems.append(f"{os.path.relpath(f, ROOT)}: calls {lib}'s client library "
                                f"({pat.search(text).group(0)}...)")

    for a, bs in edges.items():
        for b in bs:
            if layer_of[b] < layer_of[a]:
                problems.append(f"{a} ({LAYERS[layer_of[a]][0]}) includes {b} "
                                f"({LAYERS[layer_of[b]][0]}), a layer above it")

    # cycles (depth-first search over the module graph)
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for b in sorted(edges.get(n, ())):
            if state.get(b) == 1:
                problems.append("cycle: " + " -> ".join(stack[stack.index(b):] + [b]))
            elif b not in state:
                visit(b)
        stack.pop()
        state[n] = 2

    for n in sorted(layer_of):
        if n not in state:
            visit(n)

    if "--dot" in sys.argv:
        print("digraph idem {\n  rankdir=TB; node [shape=box];")
        for i, (name, ms) in enumerate(LAYERS):
            print(f"  subgraph cluster_{i} {{ label=\"{name}\"; " + " ".join(ms) + "; }")
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"  {a} -> {b};")
        print("}")
    else:
        for name, ms in LAYERS:
            print(f"{name}:")
            for m in ms:
                print(f"  {m:9} -> {', '.join(sorted(edges.get(m, ()))) or '(nothing)'}")
    if problems:
        for p in problems:
            print("arch: " + p, file=sys.stderr)
        return 1
    print(f"arch: {sum(len(v) for v in edges.values())} edges between {len(layer_of)} modules; "
          "no cycle, no upward edge, client libraries only in their adapters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
