"""cost.py - the benchmark's cost model: CPU time per event, of idem's processes and of the
servers, over the interval a throughput is measured in (bench.py calls it around each run).

CPU time is utime + stime from /proc/PID/stat. Servers: PostgreSQL is the postmaster of
$IDEM_SVC_DIR/pg/data and its children (backends, WAL writer, checkpointer, ...); RabbitMQ is every
beam.smp whose command line names $IDEM_SVC_DIR. A process that starts during the interval counts
from zero; one that ends during it counts up to the last time it was seen (Meter.sample), so
stop the meter before stopping the processes measured.

    m = cost.Meter([p.pid for p in relays])   # right after they start
    ...                                        # the measured run
    cost.record(RES, "relay.1", m.stop(), events)

RES["cost"][key] is a list (one entry per round) of {"idem_us", "postgres_us", "rabbitmq_us",
"events"}: microseconds of CPU per event. table() gives bench.py's table rows (medians).
"""

import os
import statistics

TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def _stat(pid):
    """(ppid, utime + stime in ticks) of pid, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def server_pids():
    """{pid: "postgres" | "rabbitmq"} of the servers of $IDEM_SVC_DIR (empty without it)."""
    svc = os.environ.get("IDEM_SVC_DIR")
    out = {}
    if not svc:
        return out
    try:
        with open(os.path.join(svc, "pg", "data", "postmaster.pid")) as f:
            postmaster = int(f.readline())
    except (OSError, ValueError):
        postmaster = None
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        st = _stat(pid)
        if st is None:
            continue
        if postmaster is not None and (pid == postmaster or st[0] == postmaster):
            out[pid] = "postgres"
        elif "beam.smp" in _cmdline(pid) and svc in _cmdline(pid):
            out[pid] = "rabbitmq"
    return out


class Meter:
    """CPU ticks of idem's processes (pids) and of the servers, from now until stop()."""

    def __init__(self, pids=()):
        self.idem = {pid: None for pid in pids}
        self.roles = {}
        self.first = {}  # pid -> ticks when first seen (None: started after the meter)
        self.last = {}
        self.sample(first=True)

    def sample(self, first=False):
        """Takes a reading of every process measured (and picks up new server processes)."""
        roles = dict(server_pids())
        roles.update({pid: "idem" for pid in self.idem})
        self.roles.update(roles)
        for pid, role in self.roles.items():
            st = _stat(pid)
            if st is None:
                continue
            if pid not in self.first:
                self.first[pid] = st[1] if first else 0
            self.last[pid] = st[1]

    def stop(self):
        """{"idem", "postgres", "rabbitmq"}: CPU microseconds since the meter started."""
        self.sample()
        out = {"idem": 0.0, "postgres": 0.0, "rabbitmq": 0.0}
        for pid, role in self.roles.items():
            if pid in self.last:
                out[role] += (self.last[pid] - self.first[pid]) * TICK_US
        return out


def record(res, key, used, events):
    """Keeps one round's CPU per event under res["cost"][key]."""
    if not events:
        return
    res.setdefault("cost", {}).setdefault(key, []).append(
        {"idem_us": used["idem"] / events, "postgres_us": used["postgres"] / events,
         "rabbitmq_us": used["rabbitmq"] / events, "events": events})


def median(res, key, field):
    v = [x[field] for x in res.get("cost", {}).get(key, [])]
    return statistics.median(v) if v else None


def table(res, relays):
    """Rows for bench.py's table: (figure, value, unit, base, base_label, base_unit, target,
    ok_fn) with value = idem's CPU per event and the servers' beside it."""
    rows = []

    def r1(v):
        return None if v is None else round(v, 1)

    def servers(key):
        pg, mq = median(res, key, "postgres_us"), median(res, key, "rabbitmq_us")
        if pg is None or mq is None:
            return None, ""
        return r1(pg + mq), f"servers: PostgreSQL {pg:.1f} + RabbitMQ {mq:.1f}"

    mq = median(res, "raw_publish", "rabbitmq_us")
    if mq is not None:
        rows.append(("CPU per message, raw confirmed publish (RabbitMQ's)", r1(mq), "us/event",
                     None, "", "", "", None))
    mq2 = median(res, "raw_publish_v2", "rabbitmq_us")
    if mq2 is not None:
        rows.append(("CPU per message, raw confirmed publish, wire v2 (RabbitMQ's)", r1(mq2),
                     "us/event", None, "", "", "", None))
    for k in relays:
        base, label = servers(f"relay.{k}")
        rows.append((f"CPU per event, relay, {k} process{'es' if k > 1 else ''}",
                     r1(median(res, f"relay.{k}", "idem_us")), "us/event", base, label,
                     "us/event", "", None))
    base, label = servers("consumer")
    rows.append(("CPU per event, consumer", r1(median(res, "consumer", "idem_us")), "us/event",
                 base, label, "us/event", "", None))
    return rows
