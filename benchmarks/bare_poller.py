"""The baseline for the forwarder's footprint: the few lines anyone would write to watch Scheduled Events and pass
them on to Event Hubs.

    BARE_POLLER_SAS_KEY=... python benchmarks/bare_poller.py http://127.0.0.1:PORT/vm/NAME \
        [https://127.0.0.1:PORT/HUB KEY_NAME]

Polls the scheduled-events document once a second with ``requests``, parses it and keeps the last one; given a hub
(Event Hubs' REST API, over TLS as in Azure, verified with the usual ``REQUESTS_CA_BUNDLE``), POSTs each new document
and a heartbeat every 60 s to it with a SAS token, on one kept-alive session: no spool, no hooks, no listener. Run by
benchmarks/forwarder_footprint.py beside the forwarder, on the same emulators, so that both are measured in one run
on one machine, both speaking TLS to the same endpoint.
"""

import base64
import hashlib
import hmac
import os
import sys
import time
from urllib.parse import quote

import requests

url = sys.argv[1].rstrip("/") + "/metadata/scheduledevents?api-version=2020-07-01"
hub = sys.argv[2].rstrip("/") if len(sys.argv) > 2 else None
key_name = sys.argv[3] if len(sys.argv) > 3 else ""
key = os.environ.get("BARE_POLLER_SAS_KEY", "")
session = requests.Session()


def send(body: bytes) -> None:
    assert hub is not None
    expiry = str(int(time.time()) + 3600)
    resource = quote(hub.replace("https://", "http://", 1), safe="")
    signature = base64.b64encode(hmac.new(key.encode(), f"{resource}\n{expiry}".encode(), hashlib.sha256).digest())
    token = f"SharedAccessSignature sr={resource}&sig={quote(signature, safe='')}&se={expiry}&skn={key_name}"
    session.post(hub + "/messages", data=body, headers={"Authorization": token}, timeout=10).raise_for_status()


last = None
heartbeat = 0.0
while True:
    response = requests.get(url, headers={"Metadata": "true"}, timeout=10)
    document = response.json()
    if document != last:
        last = document
        if hub:
            send(response.content)
    if hub and time.monotonic() - heartbeat >= 60:
        heartbeat = time.monotonic()
        send(b'{"kind":"heartbeat"}')
    time.sleep(1.0)
