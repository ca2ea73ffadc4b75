"""The IMDS emulator's Event Grid face (preview feature of the platform): its events published as
``Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted`` Event Grid events to an event hub,
as the system topic's event subscription with an Event Hubs destination delivers them.

Takes an ``ImdsEmulator``, the Event Hubs connection string (the Event Hubs emulator's) and the VMs whose scale set
(or VM) has ``scheduledEventsPolicy.scheduledEventsAdditionalPublishingTargets.eventGridAndResourceGraph`` on;
gives one Event Grid event per status an event of those VMs takes (Scheduled, Started, Completed, Canceled), sent with
the real ``azure-eventhub`` producer and no partition key (the platform's messages carry none). ``duplicate`` sends
each twice with the same Event Grid id (the docs: "in rare cases the same notification might be broadcasted ...
multiple times"); ``as_array`` wraps each in a JSON array (Event Grid may deliver either shape).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from azure.eventhub import EventData

from emulators.eventhubs.clients import producer_client
from emulators.imds.server import ImdsEmulator

EVENT_TYPE = "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"


class EventGridPublisher:
    """Publishes status changes of the emulator's events for ``vms``; ``publish()`` runs one pass (tests call it
    directly), ``start()`` runs passes every ``interval`` seconds on a thread."""

    def __init__(
        self,
        imds: ImdsEmulator,
        *,
        connection_string: str,
        eventhub_name: str,
        vms: Iterable[str],
        duplicate: bool = False,
        as_array: bool = False,
        interval: float = 0.2,
    ) -> None:
        self._imds = imds
        self._producer = producer_client(connection_string, eventhub_name=eventhub_name)
        self._vms = set(vms)
        self._duplicate = duplicate
        self._as_array = as_array
        self._interval = interval
        self._published: dict[str, str] = {}
        self._last_time: datetime | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def _event_time(self) -> datetime:
        # Strictly increasing, so that a Started published in the same emulated instant as its Scheduled orders
        # after it (the coordinator orders an event's statuses by eventTime).
        now = self._imds.clock.now()
        if self._last_time is not None and now <= self._last_time:
            now = self._last_time + timedelta(microseconds=1)
        self._last_time = now
        return now

    def _target(self, summary: dict[str, Any]) -> str:
        specs = {vm.name: vm for vm in self._imds.vms()}
        vm = specs[next(name for name in summary["Resources"] if name in self._vms)]
        if vm.vmScaleSetName:
            return (
                f"/subscriptions/{vm.subscriptionId}/resourceGroups/{vm.resourceGroupName}"
                f"/providers/Microsoft.Compute/virtualMachineScaleSets/{vm.vmScaleSetName}"
            )
        return vm.resourceId

    def grid_event(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The Event Grid event for an event's present status (the documented sample's shape)."""
        resource = f"{self._target(summary)}/providers/microsoft.maintenance/scheduledevents/{summary['EventId']}"
        location = next((vm.location for vm in self._imds.vms() if vm.name in summary["Resources"]), "")
        return {
            "id": str(uuid.uuid4()),
            "topic": "/subscriptions/" + resource.split("/")[2],
            "subject": resource,
            "data": {
                "resourceInfo": {
                    "id": resource,
                    "name": summary["EventId"],
                    "type": "microsoft.maintenance/scheduledEvents",
                    "location": location,
                    "properties": {
                        "DurationInSeconds": summary["DurationInSeconds"],
                        "Description": summary["Description"],
                        "EventId": summary["EventId"],
                        "EventSource": summary["EventSource"],
                        "EventStatus": summary["state"],
                        "EventType": summary["EventType"],
                        "NotBefore": summary["NotBefore"],
                        "Resources": summary["Resources"],
                        "ResourceType": "VirtualMachine",
                    },
                },
                "apiVersion": "2024-07-01",
            },
            "eventType": EVENT_TYPE,
            "dataVersion": "3.0",
            "metadataVersion": "1",
            "eventTime": self._event_time().isoformat(),
        }

    def publish(self) -> int:
        """One pass: every status change since the last pass, sent. Returns how many Event Grid events were sent."""
        bodies = []
        for summary in self._imds.events():
            if not self._vms.intersection(summary["Resources"]):
                continue
            if self._published.get(summary["EventId"]) == summary["state"]:
                continue
            self._published[summary["EventId"]] = summary["state"]
            event = self.grid_event(summary)
            body = json.dumps([event] if self._as_array else event)
            bodies.extend([body] * (2 if self._duplicate else 1))
        if bodies:
            batch = self._producer.create_batch()
            for body in bodies:
                batch.add(EventData(body))
            self._producer.send_batch(batch)
            self.sent += len(bodies)
        return len(bodies)

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(self._interval):
                self.publish()

        self._thread = threading.Thread(target=run, name="imds-event-grid", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Idempotent: the last pass's sends are over when it returns."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._producer.close()
