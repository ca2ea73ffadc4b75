"""The proof every listener answer carries: IMDS's attested document for its decision (``decision_nonce``), so that
the coordinator knows this VM answered, not another instance listening on this hybrid connection. Without one (IMDS
refused it) the answer goes as it is, and a coordinator requiring proof sends again. Used by forwarder/approver.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from contracts.attested import decision_nonce
from contracts.wire import Attestation
from forwarder.imds import ImdsError
from forwarder.logs import fields

__all__ = ["PROOF_ENTRIES", "PROOF_REUSE_SECONDS", "PROOF_WAIT_SECONDS", "Proofs"]

log = logging.getLogger("forwarder.approver")

# How long one decision's proof answers its requests: requests arriving together and quick resends share one. Short,
# because the listener cannot read the signed document's expiresOn and Microsoft's samples show lifetimes from
# seconds to 6 hours (emulators/imds/attested.py); a coordinator refuses an expired proof and sends again.
PROOF_REUSE_SECONDS = 10.0
PROOF_ENTRIES = 16
# How long a request waits for the proof another request for its decision is asking IMDS for (the IMDS client's
# own deadline is shorter); without it the answer goes without proof.
PROOF_WAIT_SECONDS = 15.0


class Proofs:
    """``attest(nonce)``: IMDS's attested document (``ImdsClient.get_attestation``); None: answers go unproven."""

    def __init__(self, attest: Callable[[str], Attestation] | None) -> None:
        self._attest = attest
        # The last proofs made, by decisionId (monotonic time made): requests for one decision share one.
        self._proofs: OrderedDict[str, tuple[float, Attestation]] = OrderedDict()
        self._making: dict[str, Future[Attestation | None]] = {}  # proofs being asked for, by decisionId
        self._lock = threading.Lock()

    def proof(self, decision_id: str) -> Attestation | None:
        """IMDS's attested document for the decision, or None.

        One document per decision, shared by every request for it within ``PROOF_REUSE_SECONDS``: the nonce names
        the decision, not the request. Three runs sending one decision at once each spent one of the VM's IMDS
        requests on it, and the POST behind them lapsed."""
        if self._attest is None:
            return None
        with self._lock:
            kept = self._proofs.get(decision_id)
            if kept is not None and time.monotonic() - kept[0] < PROOF_REUSE_SECONDS:
                return kept[1]
            making = self._making.get(decision_id)
            mine = making is None
            if making is None:
                making = self._making[decision_id] = Future()
        if not mine:
            try:  # another request for this decision is asking IMDS: its answer is this one's too
                return making.result(timeout=PROOF_WAIT_SECONDS)
            except FutureTimeout:
                return None
        made = time.monotonic()
        proof: Attestation | None = None
        try:
            proof = self._attest(decision_nonce(decision_id))
        except (ImdsError, ValueError) as error:
            log.warning("approval answer without proof", extra=fields(decisionId=decision_id, error=str(error)))
        finally:
            with self._lock:
                del self._making[decision_id]
                if proof is not None:
                    self._proofs[decision_id] = (made, proof)
                    while len(self._proofs) > PROOF_ENTRIES:
                        self._proofs.popitem(last=False)
            making.set_result(proof)
        return proof
