"""The chaos run's audit: idem's end state against the scenario's plan.

Each check returns a Line (ok, what, figures). Expectations come from scenario.Expected (the
committed operations applied one by one in commit order), never from idem's tables; idem's
tables are only what is being judged.
"""

from collections import Counter, defaultdict

from scenario import md5_uuid


class Line:
    def __init__(self, ok, what, figures, **counts):
        self.ok = bool(ok)
        self.what = what
        self.figures = figures
        self.counts = counts  # the headline figures (missing, doubled, out_of_order) by name


def fetch_state(conn, consumer):
    """Everything the audit judges, read in one repeatable-read snapshot."""
    conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
    st = {}
    with conn.cursor() as cur:
        cur.execute("SELECT event_id::text, event_type, subscription_id::text, status"
                    " FROM idem.event_outbox")
        st["outbox"] = cur.fetchall()
        cur.execute("SELECT consumer, event_id::text FROM idem.consumed_events")
        st["ledger"] = cur.fetchall()
        cur.execute("SELECT subscription_id::text, event_id::text, app, xid::text, n"
                    " FROM chaos.effects ORDER BY n")
        st["effects"] = cur.fetchall()
        cur.execute("SELECT subscription_id::text, step FROM billing.dunning")
        st["dunning"] = dict(cur.fetchall())
        cur.execute("SELECT invoice_id::text, subscription_id::text, amount_cents, currency,"
                    " event_id::text FROM billing.revenue_entries")
        st["revenue"] = cur.fetchall()
        cur.execute("SELECT invoice_id::text, subscription_id::text, event_id::text FROM billing.receipts")
        st["receipts"] = cur.fetchall()
    conn.commit()
    return st


def _examples(items, n=3):
    items = list(items)
    s = ", ".join(str(x) for x in items[:n])
    return s + (f" (+{len(items) - n} more)" if len(items) > n else "")


def check_workload(plan_counts, committed_ops, emit_errors):
    ok = committed_ops == plan_counts["transactions"]
    return Line(ok, "workload: every planned business transaction committed",
                f"{committed_ops} of {plan_counts['transactions']} transactions "
                f"({plan_counts['operations']} operations + {plan_counts['replays']} replays); "
                f"{emit_errors} failed round trips retried")


def check_outbox_events(exp, st):
    rows = {r[0]: r for r in st["outbox"]}
    missing = [e for e in exp.events if e not in rows]
    extra = [e for e in rows if e not in exp.events]
    wrong = [e for e, (t, sub) in exp.events.items()
             if e in rows and (rows[e][1] != t or rows[e][2] != sub)]
    by_type = Counter(t for t, _ in exp.events.values())
    ok = not missing and not extra and not wrong and len(rows) == len(exp.events)
    fig = (f"planned {len(exp.events)} ({by_type['payment.failed']} payment.failed, "
           f"{by_type['invoice.paid']} invoice.paid, {by_type['receipt.requested']} "
           f"receipt.requested); outbox {len(rows)}: {len(missing)} missing, {len(extra)} "
           f"unplanned, {len(wrong)} with the wrong type or subscription")
    if not ok:
        fig += "; e.g. " + _examples(missing + extra + wrong)
    return Line(ok, "outbox: exactly the planned events (replays collapsed, "
                    "one receipt.requested per paid invoice)", fig)


def check_outbox_sent(st):
    c = Counter(r[3] for r in st["outbox"])
    ok = c["pending"] == 0 and c["failed"] == 0
    return Line(ok, "outbox fully sent: no pending, no failed rows",
                f"{c['sent']} sent, {c['pending']} pending, {c['failed']} failed")


def check_ledger(exp, st, consumer):
    per_event = Counter(e for c, e in st["ledger"] if c == consumer)
    others = sorted({c for c, _ in st["ledger"] if c != consumer})
    missing = [e for e in exp.events if e not in per_event]
    strays = [e for e in per_event if e not in exp.events]
    doubled = [e for e, n in per_event.items() if n > 1]
    ok = not missing and not strays and not doubled and not others
    fig = (f"{len(exp.events)} events, {sum(per_event.values())} ledger rows of {consumer}: "
           f"{len(missing)} missing, {len(doubled)} doubled, {len(strays)} not planned")
    if others:
        fig += f"; rows of other consumers: {', '.join(others)}"
    if missing:
        fig += "; missing e.g. " + _examples(
            f"{e} ({exp.events[e][0]})" for e in missing)
    return Line(ok, f"ledger: every event applied exactly once by consumer {consumer}", fig,
                missing=len(missing), doubled=len(doubled))


def check_order(exp, st):
    """Per subscription, the business events must take effect in emit order: the handlers'
    effects (dunning changes and revenue entries, numbered by a trigger as they are made;
    chaos.effects) must name the subscription's events in the order they were emitted. A dunning
    row is locked by each change, so this is the real order, whichever processes made them. (The
    order of claims in the ledger is not: a consumer that waits on another's claim may have
    claimed an event of another subscription first.)"""
    seen, who = {}, {}
    for sub, event_id, app, xid, n in st["effects"]:
        order = seen.setdefault(sub, [])
        if not order or order[-1] != event_id:  # invoice.paid: revenue, then the reset
            order.append(event_id)
        who.setdefault(event_id, f"{app} xid {xid} n {n}")
    bad = {}
    checked = 0
    for sub, events in exp.order.items():
        pos = {e: i for i, e in enumerate(events)}
        got = [e for e in seen.get(sub, []) if e in pos]
        checked += len(got)
        for a, b in zip(got, got[1:]):
            if pos[b] <= pos[a]:
                bad.setdefault(sub, f"{sub}: event #{pos[b] + 1} ({exp.events[b][0]}, {who[b]}) "
                                    f"took effect after #{pos[a] + 1} ({who[a]})")
                break
    ok = not bad and checked > 0
    fig = (f"{len(exp.order)} subscriptions, {checked} business events checked, "
           f"{len(bad)} subscriptions out of order")
    if bad:
        fig += "; e.g. " + _examples(bad.values(), 2)
    return Line(ok, "order: each subscription's events applied in emit order", fig,
                out_of_order=len(bad))


def check_dunning(exp, st):
    have = st["dunning"]
    wrong = [s for s, step in exp.dunning.items() if have.get(s) != step]
    extra = [s for s in have if s not in exp.dunning]
    at_zero = sum(1 for v in exp.dunning.values() if v == 0)
    steps = [v for v in exp.dunning.values() if v > 0]
    ok = not wrong and not extra
    fig = (f"{len(exp.subs)} subscriptions: {len(exp.dunning)} with a row ({at_zero} back at "
           f"step 0, {len(steps)} in dunning at steps {min(steps, default=0)}.."
           f"{max(steps, default=0)}), {len(exp.subs) - len(exp.dunning)} without; "
           f"{len(wrong)} wrong steps, {len(extra)} unexpected rows")
    if wrong:
        fig += "; e.g. " + _examples(f"{s} step {have.get(s)} (expected {exp.dunning[s]})"
                                     for s in wrong)
    return Line(ok, "dunning: each subscription's step = its events applied in emit order", fig)


def check_revenue(exp, st):
    by_inv = defaultdict(list)
    for inv, sub, amount, currency, event_id in st["revenue"]:
        by_inv[inv].append((sub, amount, currency, event_id))
    bad = []
    for inv_id, inv in exp.paid.items():
        want = (inv.subscription_id, inv.amount_cents, inv.currency, md5_uuid(f"{inv_id}:paid"))
        if by_inv.get(inv_id) != [want]:
            bad.append(inv_id)
    extra = [i for i in by_inv if i not in exp.paid]
    ok = not bad and not extra
    fig = (f"{len(exp.paid)} paid invoices, {len(st['revenue'])} revenue entries: {len(bad)} "
           f"invoices without exactly one right entry, {len(extra)} unpaid invoices with one")
    if bad:
        fig += "; e.g. " + _examples(f"{i}: {by_inv.get(i, [])}" for i in bad)
    return Line(ok, "revenue: one entry per paid invoice (amount, currency, event, "
                    "subscription)", fig)


def receipt_id(invoice_id):
    """invoice.paid's follow-up: key idem:<the invoice.paid's event id>:receipt."""
    return md5_uuid("idem:" + md5_uuid(f"{invoice_id}:paid") + ":receipt")


def check_receipts(exp, st):
    by_inv = defaultdict(list)
    for inv, sub, event_id in st["receipts"]:
        by_inv[inv].append((sub, event_id))
    bad = [i for i, inv in exp.paid.items()
           if by_inv.get(i) != [(inv.subscription_id, receipt_id(i))]]
    extra = [i for i in by_inv if i not in exp.paid]
    ok = not bad and not extra
    fig = (f"{len(exp.paid)} paid invoices, {len(st['receipts'])} receipts: {len(bad)} invoices "
           f"without exactly one, {len(extra)} unpaid invoices with one")
    return Line(ok, "receipts: one per paid invoice", fig)


def check_broker(queue_counts, work_queues, dlq, dead_lettered, reasons):
    """queue_counts: {queue: messages} of the queues that exist, after the consumers stopped;
    reasons: Counter of the dead letters' error codes."""
    missing = [q for q in work_queues + [dlq] if q not in queue_counts]
    left = {q: queue_counts[q] for q in work_queues if q in queue_counts}
    in_dlq = queue_counts.get(dlq, 0)
    ok = not missing and not any(left.values()) and in_dlq == 0 and dead_lettered == 0
    fig = ", ".join(f"{q} {n}" for q, n in left.items())
    fig += f"; {dlq} {in_dlq}"
    if reasons:
        fig += " (" + ", ".join(f"{n} {r}" for r, n in reasons.most_common()) + ")"
    fig += f"; consumers' dead_lettered metric, as scraped: {dead_lettered:g}"
    if missing:
        fig += f"; queues missing: {', '.join(missing)}"
    return Line(ok, "broker: every queue drained, nothing dead-lettered", fig)


def check_drain(drained_after, limit, since):
    if drained_after is None:
        return Line(False, f"drained within {limit:g} s of the last fault",
                    f"not drained {limit:g} s after {since}")
    return Line(drained_after <= limit, f"drained within {limit:g} s of the last fault",
                f"drained {drained_after:.1f} s after {since}")


def check_processes(instances, problems):
    counts = ", ".join(f"{n}: {k}" for n, k in instances.items())
    ok = not problems
    fig = f"instances started: {counts}"
    if problems:
        fig += "; " + "; ".join(problems[:6]) + (f" (+{len(problems) - 6} more)"
                                                 if len(problems) > 6 else "")
    return Line(ok, "processes: no unplanned exits; all stopped cleanly on SIGTERM", fig)


def check_faults(planned, kinds):
    done = [f for f in planned if f.started is not None]
    failed = [f for f in done if not f.ok]
    covered = {f.kind for f in done if f.ok}
    uncovered = sorted(set(kinds) - covered)
    ok = len(done) == len(planned) and not failed and not uncovered
    fig = (f"{len(planned)} planned, {len(done)} injected, {len(failed)} could not be; "
           f"{len(covered)} of {len(kinds)} kinds covered")
    if uncovered:
        fig += f"; not covered: {', '.join(uncovered)}"
    if failed:
        fig += "; " + _examples(f"{f.kind} at {f.started_at:.1f}s: {f.detail}" for f in failed)
    return Line(ok, "faults: every planned fault injected", fig)
