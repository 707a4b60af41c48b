"""The business side of the chaos run: threads that commit the scenario's transactions.

Each subscription belongs to one thread, which commits that subscription's operations strictly
in plan order, so per subscription the commit order is known without asking idem. A thread
sends every transaction that is due in one round trip (many BEGIN ... COMMIT blocks in one
simple query), paced so the whole plan spreads over the run. When a round trip fails the
outcome of its last transaction is unknown: the thread reconnects if needed and sends the same
transactions again. That is safe and keeps the order: a transaction that did commit replays
with the same dedup key (its idem_emit collapses, its invoice write is idempotent), and the
simple query protocol stops at the first error, so what committed is a prefix of the batch.
"""

import random
import threading
import time

import psycopg2

# The business transactions, as scripts/demo/render.sql writes them: an invoice write and the
# event, committed together (tables from scripts/demo/schema.sql).
PAY_SQL = """BEGIN;
UPDATE invoices SET status = 'paid', paid_at = now() WHERE invoice_id = %(inv)s AND status <> 'paid';
SELECT idem.idem_emit('invoice.paid', subscription_id, invoice_id || ':paid', payload)
  FROM invoice_events WHERE invoice_id = %(inv)s;
COMMIT;
"""
FAIL_SQL = """BEGIN;
UPDATE invoices SET status = 'failed', failed_attempts = GREATEST(failed_attempts, %(k)s)
  WHERE invoice_id = %(inv)s AND status <> 'paid';
SELECT idem.idem_emit('payment.failed', subscription_id, invoice_id || ':failed:' || %(k)s,
                 payload || jsonb_build_object('attempt_no', %(k)s))
  FROM invoice_events WHERE invoice_id = %(inv)s;
COMMIT;
"""


def load_business_data(conn, scenario):
    """Inserts the scenario's subscriptions and open invoices (one transaction)."""
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO subscriptions (subscription_id, customer) VALUES (%s, %s)",
                        [(s, f"customer-{i}") for i, s in enumerate(scenario.subs)])
        rows = [(i.invoice_id, i.subscription_id, i.amount_cents, i.currency)
                for i in scenario.invoices.values()]
        for k in range(0, len(rows), 2000):
            args = ",".join(cur.mogrify("(%s, %s, %s, %s)", r).decode() for r in rows[k:k + 2000])
            cur.execute("INSERT INTO invoices (invoice_id, subscription_id, amount_cents, currency)"
                        " VALUES " + args)
    conn.commit()


class EmitterThread(threading.Thread):
    """Commits the operations of its subscriptions, each subscription's in plan order,
    interleaved at random across subscriptions, evenly paced over `duration` seconds."""

    MAX_BATCH = 40

    def __init__(self, index, pg_url, scenario, subs, duration, seed, stop_event):
        super().__init__(name=f"emitter{index}", daemon=True)
        self.pg_url = pg_url
        self.duration = duration
        self.stop_event = stop_event
        self.committed = {sub: [] for sub in subs}  # sub -> [Op], in commit order
        self.n_committed = 0
        self.errors = 0
        self.last_error = ""
        self.done = False
        rng = random.Random(f"emitter-{seed}-{index}")
        # A random merge of the subscriptions' sequences (each one stays in order).
        queues = {sub: list(scenario.ops[sub]) for sub in subs}
        order = [sub for sub in subs for _ in queues[sub]]
        rng.shuffle(order)
        self.ops = [queues[sub].pop(0) for sub in order]
        self.conn = None

    def _connect(self):
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg2.Error:
                pass
            self.conn = None
        self.conn = psycopg2.connect(self.pg_url, connect_timeout=3,
                                     application_name="chaos-emitter")
        self.conn.autocommit = True  # the batch carries its own BEGIN / COMMIT

    def _sql(self, cur, ops):
        parts = []
        for op in ops:
            if op.kind == "pay":
                parts.append(cur.mogrify(PAY_SQL, {"inv": op.invoice.invoice_id}))
            else:
                parts.append(cur.mogrify(FAIL_SQL, {"inv": op.invoice.invoice_id,
                                                    "k": op.attempt_no}))
        return b"".join(parts)

    def run(self):
        n = len(self.ops)
        t0 = time.monotonic()
        i = 0
        backoff = 0.1
        while i < n and not self.stop_event.is_set():
            due = int((time.monotonic() - t0) / self.duration * n) + 1 if self.duration > 0 else n
            if due <= i:
                # The next transaction's due time, read again: it may have passed meanwhile.
                time.sleep(max(0.0, min(0.05, (i + 1) * self.duration / n
                                        - (time.monotonic() - t0))))
                continue
            batch = self.ops[i:min(due, i + self.MAX_BATCH)]
            try:
                if self.conn is None or self.conn.closed:
                    self._connect()
                with self.conn.cursor() as cur:
                    cur.execute(self._sql(cur, batch))
            except psycopg2.Error as e:
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                # The session may be left inside the failed transaction.
                try:
                    if self.conn is not None and not self.conn.closed:
                        self.conn.cursor().execute("ROLLBACK")
                except psycopg2.Error:
                    self.conn = None
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            for op in batch:
                self.committed[op.subscription_id].append(op)
            i += len(batch)
            self.n_committed = i
        self.done = i >= n
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg2.Error:
                pass
