"""Azure Functions entry points (Python v2 programming model). Thin: each function hands its input to coordinator.

App settings the triggers read: ``EventHubConnection__fullyQualifiedNamespace`` (identity-based connection; the
app's identity needs "Azure Event Hubs Data Receiver" on each hub), ``EVENTHUB_NAME`` (the VMs' envelopes),
``PLATFORM_EVENTHUB_NAME`` (Event Grid's scheduled events: a hub only the system topic may send to),
``EVENTHUB_CONSUMER_GROUP`` (the coordinator's, on both);
everything else is ``COORDINATOR_*`` (coordinator/settings.py). With ``APPLICATIONINSIGHTS_CONNECTION_STRING`` set,
the coordinator's spans and metrics (adapters/telemetry.py) go to Application Insights through the Azure Monitor
OpenTelemetry distro, configured once here; ``APPLICATIONINSIGHTS_AUTHENTICATION_STRING`` (``Authorization=AAD;
ClientId=…``) makes the exporter sign in with the app's managed identity.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import azure.functions as func
from opentelemetry import trace

from coordinator import (
    DELIVERY_QUEUE,
    FORM_KEY_NAME,
    Access,
    Coordinator,
    CoordinatorSettings,
    RawMessage,
    Response,
    approve,
    build_coordinator,
)
from coordinator import SERVICE_NAME as COORDINATOR_SERVICE_NAME
from coordinator import pending_events as pending_events_page

app = func.FunctionApp(http_auth_level=func.AuthLevel.FUNCTION)
log = logging.getLogger("function_app")


def _configure_telemetry() -> None:
    """The OpenTelemetry SDK and the Azure Monitor exporters, once per worker process, only where Application Insights
    is configured (never locally: python -m local collects in-process, local/telemetry.py)."""
    if not os.environ.get("APPLICATIONINSIGHTS_CONNECTION_STRING"):
        return
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # configured already (the worker's own Application Insights option): providers are set once
    from azure.monitor.opentelemetry import configure_azure_monitor  # noqa: PLC0415 -- only in Azure
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource  # noqa: PLC0415

    # Logs already reach Application Insights through the Functions host; the distro adds spans and metrics.
    configure_azure_monitor(resource=Resource.create({SERVICE_NAME: COORDINATOR_SERVICE_NAME}), disable_logging=True)


_configure_telemetry()


@functools.cache
def settings() -> CoordinatorSettings:
    return CoordinatorSettings.from_env()


@functools.cache
def coordinator() -> Coordinator:
    # Built once per worker process: clients keep their connections between invocations.
    return build_coordinator(settings())


def _raw(event: func.EventHubEvent, properties: Mapping[str, Any]) -> RawMessage:
    offset = event.offset
    traceparent, tracestate = properties.get("traceparent"), properties.get("tracestate")
    return RawMessage(
        body=event.get_body(),
        partition_key=event.partition_key,
        sequence_number=event.sequence_number,
        offset=None if offset is None else str(offset),
        enqueued_time=event.enqueued_time,
        traceparent=traceparent if isinstance(traceparent, str) else "",
        tracestate=tracestate if isinstance(tracestate, str) else "",
    )


def application_properties(events: list[func.EventHubEvent]) -> list[Mapping[str, Any]]:
    """Each message's application properties. The worker gives every event of a cardinality-many batch the batch's
    one trigger metadata, whose ``PropertiesArray`` lists them in the batch's order (``Properties`` for one event);
    read once, from the first event."""
    metadata = events[0].metadata if events else None
    many = metadata.get("PropertiesArray") if metadata else None
    if isinstance(many, list) and len(many) == len(events):
        return [item if isinstance(item, dict) else {} for item in many]
    one = metadata.get("Properties") if metadata else None
    if len(events) == 1 and isinstance(one, dict):
        return [one]
    return [{} for _ in events]


_BatchFunction = Callable[[list[func.EventHubEvent]], None]


def _hub_trigger(event_hub_name: str) -> Callable[[_BatchFunction], Any]:
    """The function, named as it is, triggered by batches of many events of ``event_hub_name`` (a binding expression)
    with the coordinator's consumer group, each batch retried with backoff while it raises."""

    def register(function: _BatchFunction) -> Any:
        trigger = app.event_hub_message_trigger(
            arg_name="events",
            event_hub_name=event_hub_name,
            connection="EventHubConnection",
            cardinality=func.Cardinality.MANY,
            consumer_group="%EVENTHUB_CONSUMER_GROUP%",
        )
        retry = app.retry(
            strategy="exponential_backoff",
            max_retry_count="5",
            minimum_interval="00:00:02",
            maximum_interval="00:01:00",
        )
        return app.function_name(function.__name__)(retry(trigger(function)))

    return register


@_hub_trigger("%EVENTHUB_NAME%")
def ingest_envelopes(events: list[func.EventHubEvent]) -> None:
    properties = application_properties(events)
    report = coordinator().process_batch([_raw(e, p) for e, p in zip(events, properties, strict=True)])
    # What the batch did before it returned; its tail (answers, cards, history) logs "batch tail" with the rest.
    log.info("batch %s", json.dumps(report.as_dict()))


# Event Grid's own channel: the system topic's event subscription delivers to this hub, where only its identity has
# Data Sender (infra/modules/eventhubs.bicep); an Event Grid event on the VMs' hub is dead-lettered instead.
@_hub_trigger("%PLATFORM_EVENTHUB_NAME%")
def ingest_platform_events(events: list[func.EventHubEvent]) -> None:
    properties = application_properties(events)
    messages = [_raw(e, p) for e, p in zip(events, properties, strict=True)]
    report = coordinator().process_batch(messages, channel="platform")
    log.info("platform batch %s", json.dumps(report.as_dict()))


@app.function_name("reevaluate")
@app.timer_trigger(arg_name="timer", schedule="0 * * * * *", run_on_startup=False, use_monitor=True)
def reevaluate(timer: func.TimerRequest) -> None:
    report = coordinator().tick()
    log.info("tick %s (past due: %s)", json.dumps(report.as_dict()), timer.past_due)


# Approvals a batch, tick or person's approval could not deliver within its few seconds (coordinator/adapters/
# delivery_queue.py). The host's queue trigger (host.json "queues") retries a failed invocation after its
# visibilityTimeout and sets a message aside in approval-deliveries-poison after maxDequeueCount; the approval's record
# keeps it for the timer meanwhile. AzureWebJobsStorage is the host's identity-based storage connection.
@app.function_name("continue_approval")
@app.queue_trigger(arg_name="message", queue_name=DELIVERY_QUEUE, connection="AzureWebJobsStorage")
def continue_approval(message: func.QueueMessage) -> None:
    report = coordinator().continue_delivery(message.get_body())
    log.info("delivery %s (dequeued %s times)", json.dumps(report.as_dict()), message.dequeue_count)


def _access() -> Access:
    # WEBSITE_AUTH_ENABLED is injected by App Service when its authentication runs in front of the app; only then
    # is the X-MS-CLIENT-PRINCIPAL header the platform's and not the caller's.
    return Access(
        platform_auth=os.environ.get("WEBSITE_AUTH_ENABLED", "").strip().lower() == "true",
        own_origin=settings().public_base_url,
        form_key=lambda: _form_key(coordinator()),
        clock=coordinator().parts.clock,
    )


@functools.cache
def _form_key(coordinator: Coordinator) -> bytes:
    # One key for every instance (an approval page served by one instance is posted to another): kept in the
    # state table, read once per process (cached by the coordinator: a store is typed by its protocol, which
    # does not promise to be hashable).
    return coordinator.parts.store.shared_key(FORM_KEY_NAME)


def _respond(response: Response) -> func.HttpResponse:
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
        approve(
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
    return _respond(pending_events_page(coordinator(), headers=dict(req.headers), access=_access()))
