"""The delivery queue: approvals a run could not deliver within its own time continue outside it.

A batch, a timer tick or a person's approval gives each approval it sends a few seconds (``in_run_delivery``, 3 s);
one whose listener has not answered by then (hung, gone, its VM dead or slow) is handed over to this queue, an Azure
Storage queue, so that nothing else waits for it: the next batch of its Event Hubs partition and the next tick go on.
The ``continue_approval`` function (function_app.py, a queue trigger) takes each message and delivers it again with
the whole approval deadline (30 s) and the same decisionId; the Functions host retries a message whose invocation
failed (``visibilityTimeout``) and moves it to ``approval-deliveries-poison`` after ``maxDequeueCount`` (host.json).

A message says which approval to continue (``QueuedDelivery``), never what to send: the continuation reads the event
afresh and plans the request from it, so a message that arrives late, twice, or after the timer took the approval
over sends nothing (the approval no longer says it was handed over). The listener executes a decisionId at most once.

``StorageQueueDeliveries`` puts messages with one REST call (Put Message) through azure-core: in Azure with the
coordinator's managed identity (Storage Queue Data Contributor on the queue), locally with a SAS for Azurite.
Messages are base64 text, the Functions queue trigger's default encoding.
"""

from __future__ import annotations

import base64
import math
from datetime import datetime, timedelta
from typing import Protocol

from azure.core import PipelineClient
from azure.core.credentials import AzureSasCredential, TokenCredential
from azure.core.exceptions import AzureError
from azure.core.pipeline.policies import (
    AzureSasCredentialPolicy,
    BearerTokenCredentialPolicy,
    HeadersPolicy,
    HttpLoggingPolicy,
    UserAgentPolicy,
)
from azure.core.pipeline.transport import RequestsTransport
from azure.core.rest import HttpRequest, HttpResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.adapters import deadline
from coordinator.adapters.deadline import RetryPolicy

__all__ = [
    "DELIVERY_QUEUE",
    "DeliveryQueue",
    "DeliveryQueueError",
    "QueuedDelivery",
    "StorageQueueDeliveries",
]

# The queue's name in Bicep (infra/modules/storage.bicep), function_app.py's trigger and the local host.
DELIVERY_QUEUE = "approval-deliveries"
STORAGE_SCOPE = "https://storage.azure.com/.default"
# Entra ID (Bearer) needs 2017-11-09 or later.
API_VERSION = "2021-12-02"
# The total deadline of one Put Message, its retries included: a run hands an approval over after its own 3 s, and
# the queue must not hold it much longer (one that is not queued is the timer's after its grace).
PUT_DEADLINE_SECONDS = 5.0
# A message older than an hour continues nothing: the longest routine notice is 15 minutes, and the timer takes an
# approval over once its handover grace has passed.
MESSAGE_TTL = timedelta(hours=1)


class QueuedDelivery(BaseModel):
    """Which approval to continue: the event, its decision, the VM whose listener did not answer in the run that
    handed it over, and when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eventId: str = Field(min_length=1, max_length=1024)
    decisionId: str = Field(min_length=1, max_length=128)
    executor: str = Field(default="", max_length=300)
    handedOverAt: datetime


class DeliveryQueueError(RuntimeError):
    """A delivery could not be put in the queue (the timer takes the approval over after its handover grace)."""


class DeliveryQueue(Protocol):
    def put(self, delivery: QueuedDelivery, *, delay: timedelta = timedelta(0)) -> None:
        """Queue one delivery to continue now, or once ``delay`` has passed; ``DeliveryQueueError`` when it could
        not be queued."""
        ...


class StorageQueueDeliveries:
    """``DeliveryQueue`` on an Azure Storage queue (``queue_url``: ``https://{account}.queue.core.windows.net/{queue}``,
    or Azurite's ``http://127.0.0.1:P/devstoreaccount1/{queue}``), with a ``TokenCredential`` (Azure) or an
    ``AzureSasCredential`` (Azurite)."""

    def __init__(
        self,
        *,
        queue_url: str,
        credential: TokenCredential | AzureSasCredential,
        deadline_seconds: float = PUT_DEADLINE_SECONDS,
    ) -> None:
        self.queue_url = queue_url.rstrip("/")
        auth = (
            AzureSasCredentialPolicy(credential)
            if isinstance(credential, AzureSasCredential)
            else BearerTokenCredentialPolicy(credential, STORAGE_SCOPE)
        )
        # Two quick retries within the total deadline: a handover that cannot be queued within seconds is the
        # timer's (its grace), and the run that hands it over must not wait long for the queue either.
        self._client: PipelineClient[HttpRequest, HttpResponse] = PipelineClient(
            base_url=self.queue_url,
            transport=RequestsTransport(session=deadline.session()),
            policies=[
                HeadersPolicy({"x-ms-version": API_VERSION}),
                UserAgentPolicy(sdk_moniker="scheduled-events-coordinator/delivery-queue"),
                RetryPolicy(retry_total=2, retry_backoff_factor=0.2, retry_backoff_max=1, timeout=deadline_seconds),
                auth,
                HttpLoggingPolicy(),
            ],
        )
        self._deadline = deadline_seconds

    def put(self, delivery: QueuedDelivery, *, delay: timedelta = timedelta(0)) -> None:
        # Base64 (letters, digits, +, /, =) needs no XML escaping.
        text = base64.b64encode(delivery.model_dump_json().encode()).decode()
        params = {"messagettl": str(int(MESSAGE_TTL.total_seconds()))}
        if delay > timedelta(0):
            # Put Message's initial invisibility, whole seconds: rounded up, never visible before the delay.
            params["visibilitytimeout"] = str(math.ceil(delay.total_seconds()))
        request = HttpRequest(
            "POST",
            f"{self.queue_url}/messages",
            params=params,
            headers={"Content-Type": "application/xml"},
            content=f"<QueueMessage><MessageText>{text}</MessageText></QueueMessage>",
        )
        try:
            with deadline.deadline(self._deadline, f"Put Message to {self.queue_url}"):
                response = self._client.send_request(request)
        except (AzureError, deadline.DeadlineExceeded) as error:
            raise DeliveryQueueError(f"the delivery queue {self.queue_url} could not be reached: {error}") from error
        if response.status_code != 201:
            raise DeliveryQueueError(
                f"the delivery queue {self.queue_url} answered HTTP {response.status_code} to Put Message: "
                f"{response.text()[:300]}"
            )
