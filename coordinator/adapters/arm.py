"""The coordinator's one way to call Azure Resource Manager's REST API: an azure-core pipeline with the project's
policies, used by Relay administration (relay_admin.py) and the census (census.py).

A handful of REST calls each does not justify the generated management clients and their models; the api-versions
stay the ones the Bicep templates use. The pipeline: JSON, the project's user agent, azure-core's ``RetryPolicy``
(retries throttling (429) and 5xx, honours Retry-After, backs off exponentially), a bearer token for ARM from the
coordinator's identity, and azure-core's HTTP logging (which redacts the Authorization header). Every call has a
total deadline, its retries and every byte of every answer included (adapters/deadline.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from azure.core import PipelineClient
from azure.core.credentials import TokenCredential
from azure.core.pipeline.policies import (
    BearerTokenCredentialPolicy,
    HeadersPolicy,
    HttpLoggingPolicy,
    UserAgentPolicy,
)
from azure.core.pipeline.transport import RequestsTransport
from azure.core.rest import HttpRequest, HttpResponse

from coordinator.adapters import deadline
from coordinator.adapters.deadline import RetryPolicy

__all__ = ["ARM_ENDPOINT", "ARM_SCOPE", "ArmClient", "ArmOptions"]

ARM_ENDPOINT = "https://management.azure.com"
ARM_SCOPE = "https://management.azure.com/.default"
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# One ARM call's total deadline, its retries included: a new VM's hybrid connection is ensured on the setup threads
# (coordinator/service.py), the hourly housekeeping lists and deletes within a tick, and a census read pages through
# a resource group (each page within it; the read as a whole is waited for a bounded time: census.py).
ARM_DEADLINE_SECONDS = 20.0


@dataclass(frozen=True)
class ArmOptions:
    """How the coordinator calls ARM, one object for every client that does (wiring builds it from the settings).

    ``endpoint``: ARM's root (``COORDINATOR_ARM_ENDPOINT``: a sovereign cloud's; a loopback ``http://`` URL for the
    emulators only). ``retry_total`` and ``retry_backoff_factor``: azure-core's ``RetryPolicy`` (429 and 5xx, with
    Retry-After). ``deadline_seconds``: each call's total, its retries and every byte of every answer included."""

    endpoint: str = ARM_ENDPOINT
    retry_total: int = 5
    retry_backoff_factor: float = 0.8
    deadline_seconds: float = ARM_DEADLINE_SECONDS


class ArmClient:
    """ARM with the coordinator's identity, as ``options`` say. ``send`` raises azure-core's ``AzureError`` only once
    the retry policy gave up, and ``deadline.DeadlineExceeded`` past the deadline; any answer it did get (4xx
    included) is returned for the caller to read."""

    def __init__(self, *, credential: TokenCredential, moniker: str, options: ArmOptions | None = None) -> None:
        options = options or ArmOptions()
        parts = urlsplit(options.endpoint)
        self._insecure_loopback = parts.scheme == "http" and parts.hostname in _LOOPBACK
        if parts.scheme != "https" and not self._insecure_loopback:
            raise ValueError(f"ARM endpoint {options.endpoint!r} must be https:// (http:// only on loopback for tests)")
        self._deadline = options.deadline_seconds
        self._client: PipelineClient[HttpRequest, HttpResponse] = PipelineClient(
            options.endpoint.rstrip("/"),
            transport=RequestsTransport(session=deadline.session()),
            policies=[
                HeadersPolicy({"Accept": "application/json"}),
                UserAgentPolicy(sdk_moniker=f"scheduled-events-coordinator/{moniker}"),
                # timeout: the retries' total; the deadline (in send): every byte of every attempt.
                RetryPolicy(
                    retry_total=options.retry_total,
                    retry_backoff_factor=options.retry_backoff_factor,
                    retry_backoff_max=60,
                    timeout=options.deadline_seconds,
                ),
                BearerTokenCredentialPolicy(credential, ARM_SCOPE),
                HttpLoggingPolicy(),
            ],
        )

    def send(self, request: HttpRequest) -> HttpResponse:
        """The request, relative to the endpoint or absolute (a list's ``nextLink``)."""
        options: dict[str, Any] = {"enforce_https": False} if self._insecure_loopback else {}
        request.url = self._client.format_url(request.url)
        # send_request reads the whole answer (stream=False) within the deadline.
        with deadline.deadline(self._deadline, f"ARM {request.method} {request.url}"):
            return self._client.send_request(request, **options)

    def close(self) -> None:
        self._client.close()
