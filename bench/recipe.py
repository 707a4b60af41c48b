#!/usr/bin/python3
"""recipe.py - the tutorial's outbox recipe ("Using the Outbox Pattern for Reliable Billing
Events", /work/shared/seeds/outbox-billing-implementation.txt), implemented faithfully with
Debian's python3-psycopg2 and python3-pika, as the baseline that `make bench` compares idem
against. Run it with /usr/bin/python3 (the pyenv python3 on PATH has neither module).

  recipe.py relay   [--seconds S] [--batch 200]     step 3: the SKIP LOCKED relay loop
  recipe.py consume --queue Q [--seconds S] [--count N] [--prefetch 200] [--consumer recipe]
                                                    step 4: the dedup-guarded consumer

Both read IDEM_PG_URL and IDEM_AMQP_URL (and IDEM_EXCHANGE, default billing.events) and stop
after --seconds (the benchmark caps the recipe by time: it is far slower than a full backlog
allows in the time budget), or when the work runs out (relay: nothing pending, consumer:
--count messages or 2 s without a message). Each prints one JSON line: what it did and for how
long. The benchmark computes the rate from the commit timestamps it finds in the database, the
same way for idem and for the recipe.

Faithful means: relay - one transaction per tick that claims BATCH=200 pending rows
`ORDER BY created_at LIMIT 200 FOR UPDATE SKIP LOCKED`, publishes them one at a time,
synchronously (with publisher confirms, for a fair comparison: pika's BlockingChannel in confirm
mode waits for each message's confirm), and UPDATEs each row sent right after its publish, with
the recipe's attempts/failed handling; sleeps POLL_INTERVAL = 0.2 s when nothing is pending.
The recipe's partial index on created_at is created by the benchmark for this run. Consumer -
one transaction per message: INSERT INTO idem.consumed_events ... ON CONFLICT DO NOTHING RETURNING;
if claimed, advance dunning (step + 1 for the subscription); commit; then ack the message.

Translation to RabbitMQ (the recipe is written against a Kafka-like broker): the topic is the
routing key (= event_type) on the durable topic exchange, the partition key (subscription_id)
and the event id travel as headers; messages are persistent and mandatory, like idem's.
"""
import argparse
import json
import os
import sys
import time
import urllib.parse

import pika
import psycopg2

POLL_INTERVAL = 0.2  # seconds
BATCH = 200
MAX_ATTEMPTS = 8


class BrokerError(Exception):
    pass


def amqp_params():
    url = os.environ.get("IDEM_AMQP_URL") or "amqp://guest:guest@127.0.0.1:5672"
    u = urllib.parse.urlparse(url)
    vhost = urllib.parse.unquote(u.path[1:]) if u.path not in ("", "/") else "/"
    return pika.ConnectionParameters(
        host=u.hostname or "127.0.0.1",
        port=u.port or 5672,
        virtual_host=vhost,
        credentials=pika.PlainCredentials(
            urllib.parse.unquote(u.username or "guest"),
            urllib.parse.unquote(u.password or "guest"),
        ),
        heartbeat=0,
    )


def connect_db():
    return psycopg2.connect(os.environ.get("IDEM_PG_URL", ""))


# ---------------------------------------------------------------------------- step 3: relay


class Broker:
    """broker.publish(topic, key, value, headers) with a synchronous confirm per message."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.conn = pika.BlockingConnection(amqp_params())
        self.ch = self.conn.channel()
        self.ch.exchange_declare(exchange=exchange, exchange_type="topic", durable=True)
        self.ch.confirm_delivery()

    def publish(self, topic, key, value, headers):
        props = pika.BasicProperties(
            content_type="application/json",
            delivery_mode=2,
            message_id=headers["event_id"],
            type=topic,
            timestamp=int(time.time()),
            headers=dict(headers, subscription_id=key, event_type=topic),
        )
        try:
            # confirm mode: blocks until the broker confirms; raises on nack or return
            self.ch.basic_publish(
                exchange=self.exchange,
                routing_key=topic,
                body=value.encode(),
                properties=props,
                mandatory=True,
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as e:
            raise BrokerError(str(e))

    def close(self):
        try:
            self.conn.close()
        except Exception:
            pass


def alert_operator(event_id):
    print(f"recipe: event {event_id} failed {MAX_ATTEMPTS} times", file=sys.stderr)


def relay_tick(db, broker):
    with db:  # one transaction: claim, publish each, mark each, commit
        with db.cursor() as txn:
            txn.execute(
                f"""
                SELECT outbox_id, event_id, subscription_id, event_type, payload, attempts
                  FROM idem.event_outbox
                 WHERE status = 'pending'
                 ORDER BY created_at
                 LIMIT {BATCH}
                   FOR UPDATE SKIP LOCKED
                """
            )
            rows = txn.fetchall()
            for outbox_id, event_id, subscription_id, event_type, payload, attempts in rows:
                try:
                    broker.publish(
                        topic=event_type,
                        key=str(subscription_id),  # per-subscription ordering
                        value=json.dumps(payload),
                        headers={"event_id": str(event_id)},
                    )
                    txn.execute(
                        "UPDATE idem.event_outbox SET status='sent', sent_at=now() "
                        "WHERE outbox_id=%s",
                        (outbox_id,),
                    )
                except BrokerError:
                    if attempts + 1 >= MAX_ATTEMPTS:
                        txn.execute(
                            "UPDATE idem.event_outbox SET status='failed', "
                            "attempts=attempts+1 WHERE outbox_id=%s",
                            (outbox_id,),
                        )
                        alert_operator(event_id)
                    else:
                        txn.execute(
                            "UPDATE idem.event_outbox SET attempts=attempts+1 WHERE outbox_id=%s",
                            (outbox_id,),
                        )
            return len(rows)


def cmd_relay(args):
    global BATCH
    BATCH = args.batch
    db = connect_db()
    broker = Broker(os.environ.get("IDEM_EXCHANGE") or "billing.events")
    t0 = time.monotonic()
    deadline = t0 + args.seconds
    total = ticks = 0
    while time.monotonic() < deadline:
        published = relay_tick(db, broker)
        total += published
        ticks += 1
        if published == 0:
            if args.drain:
                break
            time.sleep(POLL_INTERVAL)  # idle backoff when queue is empty
    secs = time.monotonic() - t0
    broker.close()
    db.close()
    print(json.dumps({"tool": "recipe.relay", "rows": total, "ticks": ticks,
                      "seconds": round(secs, 4)}))


# ---------------------------------------------------------------------------- step 4: consumer


def advance_dunning(subscription_id, event_id, txn):
    txn.execute(
        "INSERT INTO billing.dunning (subscription_id, step, last_event_id) VALUES (%s, 1, %s) "
        "ON CONFLICT (subscription_id) DO UPDATE "
        "SET step = dunning.step + 1, updated_at = now(), last_event_id = EXCLUDED.last_event_id",
        (subscription_id, event_id),
    )


def on_payment_failed(consumer, event_id, payload, db):
    with db:  # one transaction per message
        with db.cursor() as txn:
            txn.execute(
                "INSERT INTO idem.consumed_events (consumer, event_id, consumed_at) "
                "VALUES (%s, %s, now()) ON CONFLICT DO NOTHING RETURNING event_id",
                (consumer, event_id),
            )
            claimed = txn.fetchone()
            if not claimed:
                return False  # duplicate redelivery, already handled
            advance_dunning(payload["subscription_id"], event_id, txn)
            return True


def cmd_consume(args):
    db = connect_db()
    conn = pika.BlockingConnection(amqp_params())
    ch = conn.channel()
    ch.basic_qos(prefetch_count=args.prefetch)
    t0 = time.monotonic()
    deadline = t0 + args.seconds
    got = applied = 0
    for method, props, body in ch.consume(args.queue, inactivity_timeout=args.idle):
        if method is None:  # idle
            break
        event_id = props.message_id or (props.headers or {}).get("event_id")
        payload = json.loads(body)
        if on_payment_failed(args.consumer, event_id, payload, db):
            applied += 1
        ch.basic_ack(method.delivery_tag)  # after the commit
        got += 1
        if (args.count and got >= args.count) or time.monotonic() >= deadline:
            break
    secs = time.monotonic() - t0
    try:
        ch.cancel()
        conn.close()
    except Exception:
        pass
    db.close()
    print(json.dumps({"tool": "recipe.consume", "messages": got, "applied": applied,
                      "seconds": round(secs, 4)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("relay")
    r.add_argument("--seconds", type=float, default=10.0)
    r.add_argument("--batch", type=int, default=BATCH)
    r.add_argument("--drain", action="store_true", help="stop when nothing is pending")
    c = sub.add_parser("consume")
    c.add_argument("--queue", required=True)
    c.add_argument("--seconds", type=float, default=10.0)
    c.add_argument("--count", type=int, default=0)
    c.add_argument("--prefetch", type=int, default=200)
    c.add_argument("--consumer", default="recipe")
    c.add_argument("--idle", type=float, default=2.0)
    args = ap.parse_args()
    {"relay": cmd_relay, "consume": cmd_consume}[args.cmd](args)


if __name__ == "__main__":
    main()
