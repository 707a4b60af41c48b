#!/usr/bin/env python3
"""The architecture as the code has it: which folder, module and file depends on which, checked.

src/ has a folder per layer (FOLDERS below, from the top); a folder's files may include headers
of their own folder and of the folders its row allows, nothing else. A module is a group of files
in one folder sharing a name: `consumer` is consumer.c, consumer_inbox.c, ..., consumer_int.h;
`pg` is pg.c, pg_exec.c, pg_pipeline.c, ..., pg.h, pg_int.h; and so on. A module edge A -> B
means a file of A includes a header of B; a file edge a.c -> b.c means a.c calls (or takes the
address of) a function that b.c defines.

Checks (exit 1 if one fails):
- every #include "..." of a file under src/ or handlers/ goes to its own folder or one its row of
  FOLDERS allows; every folder is in the table, every module in one folder;
- no cycle between modules, none between headers, and none between files: two files of a module
  that use each other's functions want a third file both use (a file of its own for what they
  share, or the function moved to the file it belongs with);
- only the adapters include the client libraries: <amqp*.h> in rmq only, <libpq-fe.h> in pg
  (and in the public headers, whose API takes a PGconn), and no other module calls PQ* or
  amqp_* functions; OpenSSL's headers only in rmq (the shard hash) and digest (the ledger's
  content digest);
- every module's edges go to a lower layer or its own (core -> adapters -> utilities, never up).

`scripts/arch.py` prints the folder table and the module graph by layer; `--dot` prints the
module graph for Graphviz.
"""

import collections
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Which folders each folder's files may include from (besides its own), from the top: the
# commands; the bundled handlers (the public API only); the runtimes, the operations and the
# console; the core (what handlers and emitters see); one folder per adapter, which do not use
# each other; the wire format (the envelope the adapters map messages to, the ledger's digest);
# the utilities, which include nothing of idem's. The public headers (include/idem/, included as
# <idem/...>) are for everyone.
RUNTIME_MAY = ["src/core", "src/adapters/pg", "src/adapters/rmq", "src/adapters/metrics",
               "src/wire", "src/util"]
ADAPTER_MAY = ["src/wire", "src/util"]
FOLDERS = [
    ("src/cli", ["handlers", "src/console", "src/ops", "src/relay", "src/consumer"] + RUNTIME_MAY),
    ("handlers", []),
    ("src/consumer", RUNTIME_MAY),
    ("src/relay", RUNTIME_MAY),
    ("src/ops", RUNTIME_MAY),
    ("src/console", RUNTIME_MAY),
    ("src/core", ["src/adapters/pg", "src/adapters/rmq", "src/wire", "src/util"]),
    ("src/adapters/pg", ADAPTER_MAY),
    ("src/adapters/rmq", ADAPTER_MAY),
    ("src/adapters/metrics", ADAPTER_MAY),
    ("src/wire", ["src/util"]),
    ("src/util", []),
]

# From the top: the commands, the runtimes, what handlers and emitters see, the adapters, the
# message format they map to, the utilities.
LAYERS = [
    ("cli", ["cli", "handlers"]),
    ("runtime", ["consumer", "relay", "migrate", "retain", "status", "replay", "dlq", "console"]),
    ("core", ["event", "registry", "policy", "outbox"]),
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


def rel(path):
    return os.path.relpath(path, ROOT)


def folder_of(path):
    return os.path.dirname(rel(path))


def module_of(path):
    r = rel(path)
    if r.startswith("src/cli/"):
        return "cli"
    if r.startswith("handlers/"):
        return "handlers"
    base = os.path.basename(r).rsplit(".", 1)[0]
    if base == "metrics_http":
        return "metrics"
    return base.split("_")[0]


def sources():
    files = (glob.glob(os.path.join(ROOT, "src", "**", "*.[ch]"), recursive=True)
             + glob.glob(os.path.join(ROOT, "handlers", "*.[ch]")))
    return sorted(files)


def strip(text):
    """The text without comments, string and character literals (a name in a comment or a
    message is no use of it); line breaks are kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


DEF_START = re.compile(r"^(?!static\b)[A-Za-z_][\w \t\*]*?\b(idemp?_\w+)\s*\(", re.M)


def defined(code):
    """The functions code defines with external linkage (a name followed by its parameter list
    and a body, at the start of a line)."""
    names = set()
    for m in DEF_START.finditer(code):
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
        rest = code[j:].lstrip()
        if rest.startswith("{"):
            names.add(m.group(1))
    return names


def cycles(edges, nodes):
    """For each strongly connected part of the graph (Tarjan's algorithm) with more than one
    node: one cycle through it, and all its nodes."""
    index, low, stack, on, found = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append((path_through(edges, set(part), min(part)), sorted(part)))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def path_through(edges, part, start):
    """A cycle from start back to it inside part (breadth-first, the shortest)."""
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, ())):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in part and w not in prev:
                prev[w] = v
                queue.append(w)
    return [start, start]


def main():
    allowed = dict(FOLDERS)
    layer_of = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}
    files = sources()
    headers = {}
    for f in files:
        if f.endswith(".h"):
            headers[os.path.basename(f)] = f
    edges = collections.defaultdict(set)      # module -> modules
    inc_edges = collections.defaultdict(set)  # file -> headers it includes
    fn_edges = collections.defaultdict(set)   # .c -> .c whose functions it uses
    module_folders = collections.defaultdict(set)
    problems = []
    texts = {f: open(f, encoding="utf-8").read() for f in files}
    codes = {f: strip(t) for f, t in texts.items()}
    definer = {}
    for f in files:
        if f.endswith(".c"):
            for name in defined(codes[f]):
                definer.setdefault(name, f)
    for f in files:
        m, d = module_of(f), folder_of(f)
        module_folders[m].add(d)
        if d not in allowed:
            problems.append(f"{rel(f)}: folder '{d}' is not in the table (FOLDERS)")
            continue
        if m not in layer_of:
            problems.append(f"{rel(f)}: module '{m}' is in no layer")
            continue
        text, code = texts[f], codes[f]
        for inc in re.findall(r'#include "([^"]+)"', text):
            target = headers.get(os.path.basename(inc))
            if target is None:
                continue
            inc_edges[f].add(target)
            td = folder_of(target)
            if td != d and td not in allowed[d]:
                problems.append(f"{rel(f)}: includes {rel(target)}, but {d}/ may include only "
                                f"from {', '.join(x + '/' for x in allowed[d]) or 'itself'}")
            if module_of(target) != m:
                edges[m].add(module_of(target))
        if f.endswith(".c"):
            for name in set(re.findall(r"\b(idemp?_\w+)\b", code)):
                g = definer.get(name)
                if g is not None and g != f:
                    fn_edges[f].add(g)
        for lib, pat in ADAPTER_LIBS.items():
            if m != lib and pat.search(text):
                problems.append(f"{rel(f)}: includes {lib}'s client library")
        if m not in OPENSSL_MODULES and OPENSSL.search(text):
            problems.append(f"{rel(f)}: includes OpenSSL (only "
                            f"{', '.join(sorted(OPENSSL_MODULES))} may)")
        for lib, pat in CALLS.items():
            if m != lib and pat.search(code):
                problems.append(f"{rel(f)}: calls {lib}'s client library "
                                f"({pat.search(code).group(0)}...)")
    for m, ds in sorted(module_folders.items()):
        if len(ds) > 1:
            problems.append(f"module '{m}' is in several folders: {', '.join(sorted(ds))}")

    for a, bs in edges.items():
        for b in bs:
            if b in layer_of and layer_of[b] < layer_of[a]:
                problems.append(f"{a} ({LAYERS[layer_of[a]][0]}) includes {b} "
                                f"({LAYERS[layer_of[b]][0]}), a layer above it")
    for c, part in cycles(edges, layer_of):
        problems.append("module cycle: " + " -> ".join(c))
    for c, part in cycles(inc_edges, files):
        problems.append("include cycle: " + " -> ".join(rel(f) for f in c))
    for c, part in cycles(fn_edges, [f for f in files if f.endswith(".c")]):
        steps = []
        for a, b in zip(c, c[1:]):
            used = sorted(n for n in set(re.findall(r"\b(idemp?_\w+)\b", codes[a]))
                          if definer.get(n) == b)
            steps.append(f"{rel(a)} -> ({', '.join(used[:3])}{', ...' if len(used) > 3 else ''})")
        problems.append("file cycle: " + " ".join(steps) + f" {rel(c[-1])}"
                        + (f" (all of {', '.join(rel(f) for f in part)} depend on each other)"
                           if len(part) > len(c) - 1 else ""))

    if "--dot" in sys.argv:
        print("digraph idem {\n  rankdir=TB; node [shape=box];")
        for i, (name, ms) in enumerate(LAYERS):
            print(f"  subgraph cluster_{i} {{ label=\"{name}\"; " + " ".join(ms) + "; }")
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"  {a} -> {b};")
        print("}")
    else:
        print("folders (each may include from itself and):")
        for d, may in FOLDERS:
            print(f"  {d + '/':22} -> {', '.join(x + '/' for x in may) or '(nothing)'}")
        print("modules (by layer):")
        for name, ms in LAYERS:
            print(f"{name}:")
            for m in ms:
                print(f"  {m:9} -> {', '.join(sorted(edges.get(m, ()))) or '(nothing)'}")
    if problems:
        for p in problems:
            print("arch: " + p, file=sys.stderr)
        return 1
    nfile = sum(len(v) for v in fn_edges.values())
    print(f"arch: {sum(len(v) for v in edges.values())} edges between {len(layer_of)} modules, "
          f"{nfile} between {sum(1 for f in files if f.endswith('.c'))} files; every include "
          "allowed by the folder table, no cycle, no upward edge, client libraries only in their "
          "adapters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
