"""Prints the number of ready messages in each queue named on the command line (passive declare;
-1 for a queue that does not exist). Usage: queues.py AMQP_URL QUEUE...  Debian's python3-pika."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "harness"))
from idem_harness import Broker  # noqa: E402

infos = Broker(sys.argv[1]).queue_infos(sys.argv[2:])
print(" ".join(str(-1 if infos[q] is None else infos[q][0]) for q in sys.argv[2:]))
