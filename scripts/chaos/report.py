"""The chaos run's closing report: the audit's lines over idem's end state, the figures beside
them, and the summary file of make chaos-all (scripts/chaos/matrix.py)."""

import json
import re
import time
from collections import Counter

import audit
import idem_harness as H
from daemons import CONSUMER


class Reporting:
    """The report side of Run (a mixin): needs a, pg, servers, logs, procs, emitters,
    work_queues, dlq, seams_fired, seams_armed, started, say(), now(), total()."""

    def dlq_reasons(self, limit=20000):
        """Counter of the dead letters' x-idem-error codes (with the SQLSTATE when there is
        one). Reads the DLQ without acking: the messages go back when the channel closes."""
        reasons = Counter()
        with H.Broker(self.servers.amqp_url).channel() as ch:
            ch.basic_qos(prefetch_count=0)
            for _ in range(limit):
                method, props, _ = ch.basic_get(self.dlq, auto_ack=False)
                if method is None:
                    break
                err = (props.headers or {}).get("x-idem-error", b"?")
                err = err.decode(errors="replace") if isinstance(err, bytes) else str(err)
                state = re.search(r"SQLSTATE \w{5}", err)
                reasons[err.split(":")[0] + (f" ({state.group(0)})" if state else "")] += 1
        return reasons

    def final_queue_counts(self):
        """{queue: messages} of the work queues and the DLQ once the consumers are gone (their
        unacked deliveries are back in the queues), by passive declares: rabbitmqctl's counts
        of quorum queues come from periodic statistics and lag. Two equal readings in a row."""
        broker = H.Broker(self.servers.amqp_url)
        names = self.work_queues + [self.dlq]
        last = None
        for _ in range(10):
            infos = broker.queue_infos(names)
            counts = {q: i[0] for q, i in infos.items() if i is not None}
            if counts == last:
                break
            last = counts
            time.sleep(0.3)
        return counts

    def report(self, plan, pc, plan_faults, expected, drained_after, drain_since):
        a = self.a
        committed_ops = sum(e.n_committed for e in self.emitters)
        emit_errors = sum(e.errors for e in self.emitters)
        with self.pg.connect(autocommit=False) as conn:
            st = audit.fetch_state(conn, CONSUMER)
        queue_counts = self.final_queue_counts()
        dead = self.total("consumer", "dead_lettered")
        reasons = self.dlq_reasons() if queue_counts.get(self.dlq) else Counter()
        lines = [
            audit.check_workload(pc, committed_ops, emit_errors),
            audit.check_outbox_events(expected, st),
            audit.check_outbox_sent(st),
            audit.check_ledger(expected, st, CONSUMER),
            audit.check_order(expected, st),
            audit.check_dunning(expected, st),
            audit.check_revenue(expected, st),
            audit.check_receipts(expected, st),
            audit.check_broker(queue_counts, self.work_queues, self.dlq, dead, reasons),
            audit.check_drain(drained_after, a.drain_timeout, drain_since),
            audit.check_processes({p.name: p.instances for p in self.procs.values()},
                                  self.problems),
            audit.check_faults(plan_faults, a.fault_kinds),
        ]
        by_type = Counter(r[1] for r in st["outbox"])
        kinds = Counter(f.kind for f in plan_faults if f.started is not None)
        self.say("")
        self.say(f"Closing report (seed {a.seed})")
        row = lambda k, v, t="": self.say(f"  {k:<24}{v:>8}  {t}".rstrip())  # noqa: E731
        row("subscriptions", a.subs, f"{pc['invoices']} invoices")
        row("business transactions", committed_ops,
            f"{pc['operations']} operations + {pc['replays']} replays planned")
        row("events in the outbox", len(st["outbox"]),
            f"{by_type['payment.failed']} payment.failed, {by_type['invoice.paid']} invoice.paid,")
        row("", "", f"{by_type['receipt.requested']} receipt.requested (by the invoice.paid "
                    f"handler)")
        row("published", int(self.total("relay", "published")),
            f"relays' published_total (at least; {int(self.total('relay', 'publish_failures'))} "
            f"publish failures)")
        row("consumed", len([1 for c, _ in st["ledger"] if c == CONSUMER]),
            f"ledger rows; at least {int(self.total('consumer', 'duplicates'))} duplicates "
            f"skipped, {int(self.total('consumer', 'paused'))} pauses")
        row("dead-lettered", int(dead), f"consumers' metric; {self.dlq} holds "
            f"{queue_counts.get(self.dlq, '?')}")
        row("faults injected", sum(kinds.values()), ", ".join(
            f"{k} {n}" for k, n in sorted(kinds.items())))
        fired = ", ".join(f"{k} {self.seams_fired[k]}/{self.seams_armed[k]}"
                          for k in sorted(self.seams_armed))
        row("seams fired / armed", sum(self.seams_fired.values()), fired)
        windows = [f for f in plan_faults if f.refused is not None]
        if windows:
            row("writes refused", sum(f.refused for f in windows),
                f"by the SQLSTATE triggers in {len(windows)} windows ("
                + ", ".join(str(f.refused) for f in windows) + ")")
        row("drain", "-" if drained_after is None else f"{drained_after:.1f} s",
            f"after {drain_since}" if drained_after is not None else "not drained")
        row("run time", f"{time.monotonic() - self.started:.0f} s",
            f"workload {self.now():.0f} s")
        self.say("")
        self.say("Audit")
        for ln in lines:
            self.say(f"  {'PASS' if ln.ok else 'FAIL'}  {ln.what}")
            self.say(f"        {ln.figures}")
        fails = sum(not ln.ok for ln in lines)
        if a.summary:
            self.write_summary(len(st["outbox"]), kinds, plan_faults, drained_after, lines)
        self.say("")
        if fails == 0:
            self.say(f"PASS: every event took effect exactly once, in order, under "
                     f"{sum(kinds.values())} faults (seed {a.seed}).")
        else:
            self.say(f"FAIL: {fails} of {len(lines)} audit lines failed (seed {a.seed}); "
                     f"logs in {self.logs}")
        return fails == 0

    def write_summary(self, events, kinds, plan_faults, drained_after, lines):
        a = self.a
        out = {"seed": a.seed, "topology": a.topology, "partitions": a.partitions,
               "consumers": a.consumers, "events": events, "faults": dict(sorted(kinds.items())),
               "rmq_backlog": [f.backlog for f in plan_faults if f.backlog is not None],
               "drain_s": drained_after, "ok": all(ln.ok for ln in lines), "logs": self.logs,
               "counts": {k: v for ln in lines for k, v in ln.counts.items()},
               "lines": [{"ok": ln.ok, "what": ln.what, "figures": ln.figures} for ln in lines]}
        with open(a.summary, "w") as f:
            json.dump(out, f, indent=1)
