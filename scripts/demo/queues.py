"""Prints the number of ready messages in each queue named on the command line (passive declare;
-1 for a queue that does not exist). Usage: queues.py AMQP_URL QUEUE...  Debian's python3-pika."""
import sys

import pika

params = pika.URLParameters(sys.argv[1])
params.connection_attempts = 1
params.socket_timeout = 3
conn = pika.BlockingConnection(params)
counts = []
ch = conn.channel()
for q in sys.argv[2:]:
    try:
        counts.append(ch.queue_declare(q, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker:
        counts.append(-1)
        ch = conn.channel()
print(" ".join(map(str, counts)))
conn.close()
