"""DirectImdsCallback: FOR LOCAL USE ONLY. Reaches the IMDS emulator straight over loopback HTTP.

In Azure the coordinator cannot reach a VM's IMDS (169.254.169.254 answers only inside the VM); approvals travel
through Azure Relay (coordinator/relay_sender.py). This stand-in does what the VM's relay listener does, against the
emulator's per-VM URL: read the VM's current document, approve only an EventId that is listed and still Scheduled,
then POST ``{"StartRequests": [{"EventId": ...}]}``.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit

import requests

from coordinator.callback import ApprovalDeliveryError
from forwarder.approval import ApprovalRequest, ApprovalResult
from forwarder.envelope import VmIdentity

API_VERSION = "2020-07-01"


class DirectImdsCallback:
    """``ApprovalCallback`` for the local mode and tests: ``base_url`` is the IMDS emulator (``http://127.0.0.1:P``);
    each VM is addressed as ``{base_url}/vm/{name}``."""

    def __init__(self, *, base_url: str, timeout: float = 5.0, session: requests.Session | None = None) -> None:
        host = urlsplit(base_url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"DirectImdsCallback is for a loopback IMDS emulator only, not {base_url!r}")
        self._base = base_url.rstrip("/")
        self._timeout = timeout
        self._session = session or requests.Session()

    def _url(self, vm: VmIdentity) -> str:
        return f"{self._base}/vm/{quote(vm.name, safe='')}/metadata/scheduledevents?api-version={API_VERSION}"

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        url = self._url(vm)
        headers = {"Metadata": "true"}
        try:
            current = self._session.get(url, headers=headers, timeout=self._timeout)
            if current.status_code != 200:
                raise ApprovalDeliveryError(f"IMDS of {vm.name} answered {current.status_code} to GET")
            document = current.json()
            event = next((e for e in document.get("Events", []) if e.get("EventId") == request.eventId), None)
            incarnation = document.get("DocumentIncarnation")
            if event is None:
                return ApprovalResult(
                    outcome="not-found",
                    eventId=request.eventId,
                    decisionId=request.decisionId,
                    documentIncarnation=incarnation,
                    reason=f"{request.eventId} is not in {vm.name}'s document",
                )
            if event.get("EventStatus") != "Scheduled":
                return ApprovalResult(
                    outcome="not-scheduled",
                    eventId=request.eventId,
                    decisionId=request.decisionId,
                    documentIncarnation=incarnation,
                    reason=f"{request.eventId} is {event.get('EventStatus')}",
                )
            posted = self._session.post(
                url, headers=headers, json={"StartRequests": [{"EventId": request.eventId}]}, timeout=self._timeout
            )
        except (requests.RequestException, ValueError) as error:
            raise ApprovalDeliveryError(f"IMDS of {vm.name} unreachable: {type(error).__name__}: {error}") from error
        if posted.status_code != 200:
            raise ApprovalDeliveryError(f"IMDS of {vm.name} answered {posted.status_code} to the StartRequest")
        return ApprovalResult(
            outcome="approved", eventId=request.eventId, decisionId=request.decisionId, documentIncarnation=incarnation
        )
