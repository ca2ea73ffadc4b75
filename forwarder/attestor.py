"""The forwarder's proof of whose state it is: an IMDS attested document of this VM, nonce from the stateId.

IMDS signs a document naming this VM's vmId and the nonce asked for (contracts/attestation.py: ``state_nonce``);
the coordinator verifies it and accepts envelopes about this VM only with it (docs/security.md). The poll loop calls
``tick`` once a poll: the document is fetched at start, renewed once half its life has passed, and asked again with a
backoff after a failure (IMDS down, or an answer from its cache with another nonce); the document held stays in use
until it expires. The sender attaches ``current()`` to every envelope as it sends it, so a replay after an outage
carries a document valid then, not one that expired in the spool.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from contracts.attested import state_nonce
from contracts.wire import Attestation, read_content
from forwarder.imds import ImdsClient, ImdsError
from forwarder.logs import FailureLog
from forwarder.retry import Backoff

log = logging.getLogger("forwarder")


class Attestor:
    """Holds the current attested document of the forwarder's state; thread-safe (the sender reads it)."""

    def __init__(self, *, imds: ImdsClient, state_id: str) -> None:
        self._imds = imds
        self._nonce = state_nonce(state_id)
        self._lock = threading.Lock()
        self._document: Attestation | None = None
        self._renew_at = 0.0  # wall-clock seconds: when to ask again
        self._expires_at = 0.0
        self._backoff = Backoff(initial=1.0, maximum=60.0)
        self._failures = FailureLog("IMDS attested document", logger=log)
        # The poll loop and the sender may both ask; one fetch at a time, the other goes on.
        self._fetching = threading.Lock()

    def current(self) -> Attestation | None:
        """The document to send now (None: none yet, or the last one expired)."""
        with self._lock:
            return self._document if time.time() < self._expires_at else None

    def tick(self) -> None:
        """Fetches a document when none is held or the held one is past half its life (or a retry is due)."""
        if time.time() < self._renew_at or not self._fetching.acquire(blocking=False):
            return
        try:
            self._fetch()
        finally:
            self._fetching.release()

    def _fetch(self) -> None:
        try:
            document = self._imds.get_attestation(self._nonce)
            content = read_content(document)
            created, expires = content.created_on(), content.expires_on()
        except (ImdsError, ValueError) as exc:
            self._failures.failed(exc)
            self._renew_at = time.time() + self._backoff.next_delay()
            return
        self._failures.succeeded()
        self._backoff.reset()
        now = datetime.now(UTC).timestamp()
        # Half its life from now, however IMDS's clock and this VM's differ.
        life = max(1.0, expires.timestamp() - created.timestamp())
        with self._lock:
            self._document = document
            self._expires_at = now + life
            self._renew_at = now + life / 2
