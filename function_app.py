"""Azure Functions entry points (Python v2 programming model). Thin: each function hands its input to coordinator.

App settings the triggers read: ``EventHubConnection__fullyQualifiedNamespace`` (identity-based connection; the
app's identity needs "Azure Event Hubs Data Receiver" on the hub), ``EVENTHUB_NAME``, ``EVENTHUB_CONSUMER_GROUP``;
everything else is ``COORDINATOR_*`` (coordinator/settings.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os

import azure.functions as func

from coordinator import http
from coordinator.ingest import RawMessage
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from coordinator.tables import TableStateStore
from coordinator.wiring import build_coordinator

app = func.FunctionApp(http_auth_level=func.AuthLevel.FUNCTION)
log = logging.getLogger("function_app")


@functools.cache
def settings() -> CoordinatorSettings:
    return CoordinatorSettings.from_env()


@functools.cache
def coordinator() -> Coordinator:
    # Built once per worker process: clients keep their connections between invocations.
    return build_coordinator(settings())


def _raw(event: func.EventHubEvent) -> RawMessage:
    offset = event.offset
    return RawMessage(
        body=event.get_body(),
        partition_key=event.partition_key,
        sequence_number=event.sequence_number,
        offset=None if offset is None else str(offset),
        enqueued_time=event.enqueued_time,
    )


@app.function_name("ingest_envelopes")
@app.retry(
    strategy="exponential_backoff", max_retry_count="5", minimum_interval="00:00:02", maximum_interval="00:01:00"
)
@app.event_hub_message_trigger(
    arg_name="events",
    event_hub_name="%EVENTHUB_NAME%",
    connection="EventHubConnection",
    cardinality=func.Cardinality.MANY,
    consumer_group="%EVENTHUB_CONSUMER_GROUP%",
)
def ingest_envelopes(events: list[func.EventHubEvent]) -> None:
    report = coordinator().process_batch([_raw(e) for e in events])
    log.info("batch %s", json.dumps(report.as_dict()))


@app.function_name("reevaluate")
@app.timer_trigger(arg_name="timer", schedule="0 * * * * *", run_on_startup=False, use_monitor=True)
def reevaluate(timer: func.TimerRequest) -> None:
    report = coordinator().tick()
    log.info("tick %s (past due: %s)", json.dumps(report.as_dict()), timer.past_due)


def _access() -> http.Access:
    # WEBSITE_AUTH_ENABLED is injected by App Service when its authentication runs in front of the app; only then
    # is the X-MS-CLIENT-PRINCIPAL header the platform's and not the caller's.
    return http.Access(
        platform_auth=os.environ.get("WEBSITE_AUTH_ENABLED", "").strip().lower() == "true",
        allow_anonymous=settings().allow_anonymous_approval,
        own_origin=settings().public_base_url,
        form_key=lambda: _form_key(coordinator().store),
        clock=coordinator().clock,
    )


@functools.cache
def _form_key(store: TableStateStore) -> bytes:
    # One key for every instance (an approval page served by one instance is posted to another): kept in the
    # state table, read once per process.
    return store.shared_key(http.FORM_KEY_NAME)


def _respond(response: http.Response) -> func.HttpResponse:
    return func.HttpResponse(
        response.body,
        status_code=response.status,
        mimetype=response.content_type.split(";")[0],
        charset="utf-8",
        headers=dict(response.headers),
    )


# Both routes are anonymous at the Functions level on purpose: App Service Authentication (Entra ID, required
# for every request by infra/modules/functionapp.bicep) signs the person in, and coordinator/http.py checks the
# app roles, so no function key ends up in a Teams card or in anyone's hands.
@app.function_name("approve_event")
@app.route(route="events/{event_id}/approve", methods=["GET", "POST"], auth_level=func.AuthLevel.ANONYMOUS)
def approve_event(req: func.HttpRequest) -> func.HttpResponse:
    return _respond(
        http.approve(
            coordinator(),
            method=req.method,
            event_id=req.route_params.get("event_id", ""),
            headers=dict(req.headers),
            body=req.get_body(),
            access=_access(),
        )
    )


@app.function_name("pending_events")
@app.route(route="events", methods=["GET"], auth_level=func.AuthLevel.ANONYMOUS)
def pending_events(req: func.HttpRequest) -> func.HttpResponse:
    return _respond(http.pending_events(coordinator(), headers=dict(req.headers), access=_access()))
