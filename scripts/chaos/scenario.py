"""The chaos run's billing scenario: subscriptions, invoices, the business operations in the
order each subscription commits them, and the end state they must produce.

Everything here follows from the seed alone and never reads idem's tables: the audit compares
idem's end state with what these operations mean under the bundled billing handlers'
semantics (CONTRACT.md, "Bundled billing handlers"):
  payment.failed     dunning.step += 1 (row created at step 1)
  invoice.paid       one revenue entry; dunning step to 0 if the subscription has a row (creates
                     none); emits receipt.requested (its follow-up "receipt": dedup key
                     idem:<invoice.paid event id>:receipt)
  receipt.requested  one receipt
"""

import hashlib
import random
import uuid

CURRENCIES = ("USD", "EUR", "GBP")


def md5_uuid(key):
    """What idem_emit derives from a dedup key: md5(key)::uuid, canonical lowercase."""
    return str(uuid.UUID(hashlib.md5(key.encode()).hexdigest()))


def seeded_uuid(rng):
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


class Invoice:
    def __init__(self, invoice_id, subscription_id, amount_cents, currency):
        self.invoice_id = invoice_id
        self.subscription_id = subscription_id
        self.amount_cents = amount_cents
        self.currency = currency


class Op:
    """One business transaction: an invoice write plus idem_emit, in one transaction.
    kind 'fail' (attempt attempt_no failed) or 'pay'; replay: the same operation run again with
    the same dedup key (must collapse into the event of the first run)."""

    __slots__ = ("kind", "invoice", "attempt_no", "replay")

    def __init__(self, kind, invoice, attempt_no=None, replay=False):
        self.kind = kind
        self.invoice = invoice
        self.attempt_no = attempt_no
        self.replay = replay

    @property
    def subscription_id(self):
        return self.invoice.subscription_id

    @property
    def event_type(self):
        return "invoice.paid" if self.kind == "pay" else "payment.failed"

    @property
    def dedup_key(self):
        if self.kind == "pay":
            return f"{self.invoice.invoice_id}:paid"
        return f"{self.invoice.invoice_id}:failed:{self.attempt_no}"

    @property
    def event_id(self):
        return md5_uuid(self.dedup_key)

    def as_replay(self):
        return Op(self.kind, self.invoice, self.attempt_no, True)


class Scenario:
    """subs: [subscription_id]; invoices: {invoice_id: Invoice}; ops: {subscription_id: [Op]} in
    the order that subscription's transactions must commit (replays included)."""

    def __init__(self, seed, n_subs, n_events, replay_pct=10.0):
        rng = random.Random(f"scenario-{seed}")
        self.subs = [seeded_uuid(rng) for _ in range(n_subs)]
        self.invoices = {}
        self.ops = {}
        base, extra = divmod(n_events, n_subs)
        for i, sub in enumerate(self.subs):
            self.ops[sub] = self._subscription(rng, sub, base + (1 if i < extra else 0),
                                               replay_pct)

    def _subscription(self, rng, sub, quota, replay_pct):
        """One subscription's operations: invoices until the subscription's share of events is
        reached, at most 3 of them open at once, each failing 0-4 times and then paid or not."""
        stories = []  # one list of ops per invoice, in that invoice's order
        events = 0
        while events < quota:
            inv = Invoice(seeded_uuid(rng), sub, rng.randrange(500, 20000),
                          rng.choice(CURRENCIES))
            self.invoices[inv.invoice_id] = inv
            r = rng.random()
            if r < 0.55:  # paid at the first try
                failures, paid = 0, True
            elif r < 0.85:  # fails 1-3 times, then paid
                failures, paid = rng.randint(1, 3), True
            else:  # fails 1-4 times, never paid (stays in dunning)
                failures, paid = rng.randint(1, 4), False
            story = [Op("fail", inv, k) for k in range(1, failures + 1)]
            if paid:
                story.append(Op("pay", inv))
            stories.append(story)
            events += failures + (2 if paid else 0)  # invoice.paid also yields receipt.requested

        # Interleave the invoices' stories, at most 3 open at once: realistic overlap (a new
        # invoice fails while an older one is still being chased) and order-sensitive dunning.
        seq, open_, pending = [], [], list(stories)
        while open_ or pending:
            while pending and len(open_) < 3 and (not open_ or rng.random() < 0.5):
                open_.append(pending.pop(0))
            story = rng.choice(open_)
            seq.append(story.pop(0))
            if not story:
                open_.remove(story)

        # Replays: about replay_pct % of the operations run again 1-5 places later (a client
        # retrying after a timeout, a webhook delivered twice).
        inserts = {}
        for i, op in enumerate(seq):
            if rng.random() * 100 < replay_pct:
                inserts.setdefault(i + rng.randint(1, 5), []).append(op.as_replay())
        out = []
        for i, op in enumerate(seq):
            out.extend(inserts.pop(i, []))
            out.append(op)
        for i in sorted(inserts):
            out.extend(inserts[i])
        return out

    # ------------------------------------------------------------------ figures

    def all_ops(self):
        return [op for sub in self.subs for op in self.ops[sub]]

    def counts(self):
        ops = self.all_ops()
        replays = sum(op.replay for op in ops)
        failed = sum(1 for op in ops if not op.replay and op.kind == "fail")
        paid = sum(1 for op in ops if not op.replay and op.kind == "pay")
        return {"transactions": len(ops), "replays": replays, "operations": len(ops) - replays,
                "payment.failed": failed, "invoice.paid": paid, "receipt.requested": paid,
                "events": failed + 2 * paid, "invoices": len(self.invoices)}


class Expected:
    """The end state that committed operations must produce, computed by applying each
    subscription's operations one by one in commit order. committed: {subscription_id: [Op]}."""

    def __init__(self, committed):
        self.events = {}    # event_id -> (event_type, subscription_id)
        self.order = {}     # subscription_id -> [event_id] of its business events, emit order
        self.dunning = {}   # subscription_id -> step, for subscriptions that must have a row
        self.paid = {}      # invoice_id -> Invoice (one revenue entry and one receipt each)
        self.subs = list(committed)
        for sub, ops in committed.items():
            step = None  # no dunning row
            order = []
            for op in ops:
                if op.event_id in self.events:  # a replay, or a retry after an unknown outcome
                    continue
                self.events[op.event_id] = (op.event_type, sub)
                order.append(op.event_id)
                if op.kind == "fail":
                    step = 1 if step is None else step + 1
                else:
                    inv = op.invoice
                    self.paid[inv.invoice_id] = inv
                    self.events[md5_uuid(f"idem:{op.event_id}:receipt")] = ("receipt.requested", sub)
                    if step is not None:
                        step = 0
            self.order[sub] = order
            if step is not None:
                self.dunning[sub] = step

    def count(self, event_type):
        return sum(1 for t, _ in self.events.values() if t == event_type)
