"""Azure Functions entry points (Python v2 programming model). Thin: each function hands its input to coordinator.

App settings the triggers read: ``EventHubConnection__fullyQualifiedNamespace`` (identity-based connection; the
app's identity needs "Azure Event Hubs Data Receiver" on the hub), ``EVENTHUB_NAME``, ``EVENTHUB_CONSUMER_GROUP``;
everything else is ``COORDINATOR_*`` (coordinator/settings.py).
"""

from __future__ import annotations

import functools
import json
import logging

import azure.functions as func

from coordinator import http
from coordinator.service import Coordinator, RawMessage
from coordinator.settings import CoordinatorSettings
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


@app.function_name("approve_event")
@app.route(route="events/{event_id}/approve", methods=["GET", "POST"], auth_level=func.AuthLevel.ANONYMOUS)
def approve_event(req: func.HttpRequest) -> func.HttpResponse:
    # Anonymous at the Functions level on purpose: App Service Authentication (Entra ID) signs the person in and
    # the coordinator refuses a POST without a principal, so no function key ends up in a Teams card.
    response = http.approve(
        coordinator(),
        method=req.method,
        event_id=req.route_params.get("event_id", ""),
        headers=dict(req.headers),
        body=req.get_body(),
        allow_anonymous=settings().allow_anonymous_approval,
    )
    return func.HttpResponse(response.body, status_code=response.status, mimetype=response.content_type.split(";")[0])


@app.function_name("pending_events")
@app.route(route="events", methods=["GET"])
def pending_events(req: func.HttpRequest) -> func.HttpResponse:
    response = http.pending_events(coordinator())
    return func.HttpResponse(response.body, status_code=response.status, mimetype=response.content_type)
