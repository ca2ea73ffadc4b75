"""The baseline for the forwarder's footprint: the few lines anyone would write to watch Scheduled Events.

    python benchmarks/bare_poller.py http://127.0.0.1:PORT/vm/NAME

Polls the scheduled-events document once a second with ``requests``, parses it and keeps the last one: no spool,
no sending, no hooks, no listener. Run by benchmarks/forwarder_footprint.py beside the forwarder, on the same IMDS
emulator, so that both are measured in one run on one machine.
"""

import sys
import time

import requests

url = sys.argv[1].rstrip("/") + "/metadata/scheduledevents?api-version=2020-07-01"
last = None
while True:
    response = requests.get(url, headers={"Metadata": "true"}, timeout=10)
    document = response.json()
    if document != last:
        last = document
    time.sleep(1.0)
