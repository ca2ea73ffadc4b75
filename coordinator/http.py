"""HTTP handling for the manual-approval and state endpoints, free of the Functions types (function_app adapts).

Manual approval: ``GET /api/events/{id}/approve`` shows the event and a button (a Teams card link is a GET, and a
link preview must never approve); ``POST`` approves. The person is the signed-in user that App Service
Authentication (Easy Auth, Entra ID) puts in ``X-MS-CLIENT-PRINCIPAL-NAME``; without one the request is refused
unless the local mode allows anonymous approval.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.service import Coordinator

PRINCIPAL_HEADER = "x-ms-client-principal-name"
_STATUS = {"approved": 200, "sent": 202, "not-found": 404, "conflict": 409}


@dataclass(frozen=True)
class Response:
    status: int
    body: str
    content_type: str = "application/json"


def _json(status: int, payload: Any) -> Response:
    return Response(status, json.dumps(payload, indent=1))


def pending_events(coordinator: Coordinator) -> Response:
    events = coordinator.pending()
    return _json(200, {"count": len(events), "events": events})


def approve(
    coordinator: Coordinator,
    *,
    method: str,
    event_id: str,
    headers: Mapping[str, str],
    body: bytes,
    allow_anonymous: bool,
) -> Response:
    if method.upper() == "GET":
        return _confirmation_page(coordinator, event_id)
    lowered = {k.lower(): v for k, v in headers.items()}
    person = lowered.get(PRINCIPAL_HEADER, "").strip()
    if not person:
        if not allow_anonymous:
            return _json(401, {"error": "sign in first: manual approval needs App Service Authentication (Entra ID)"})
        person = "local-user"
        if body:
            try:
                payload = json.loads(body)
            except ValueError:
                return _json(400, {"error": 'body must be JSON like {"by": "name"} or empty'})
            if isinstance(payload, dict) and isinstance(payload.get("by"), str) and payload["by"].strip():
                person = payload["by"].strip()[:128]
    result = coordinator.approve_manually(event_id, person=person)
    return _json(_STATUS[result.status], {"status": result.status, "message": result.message, "event": result.event})


def _confirmation_page(coordinator: Coordinator, event_id: str) -> Response:
    stored = coordinator.store.get_event(event_id)
    if stored is None:
        return Response(404, f"<p>No event {html.escape(event_id)} is known.</p>", "text/html; charset=utf-8")
    record = stored.record
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in (
            ("EventId", record.eventId),
            ("Type", f"{record.eventType} ({record.eventSource})"),
            ("State", record.state),
            ("NotBefore", record.notBefore.isoformat() if record.notBefore else "—"),
            ("Resources", ", ".join(record.resources)),
            ("Decision", f"{record.decision.verdict} ({record.decision.rule})" if record.decision else "—"),
        )
    )
    button = (
        '<form method="post"><button type="submit">Approve now</button></form>'
        if record.state == "Scheduled"
        else f"<p>Only a Scheduled event can be approved; this one is {html.escape(record.state)}.</p>"
    )
    page = f"<!doctype html><title>Approve {html.escape(record.eventId)}</title><table>{rows}</table>{button}"
    return Response(200, page, "text/html; charset=utf-8")
