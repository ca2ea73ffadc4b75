"""The coordinator's one way to call Azure Resource Manager's REST API: an azure-core pipeline with the project's
policies, used by Relay administration (relay_admin.py) and the census (census.py).

A handful of REST calls each does not justify the generated management clients and their models; the api-versions
stay the ones the Bicep templates use. The pipeline: JSON, the project's user agent, azure-core's ``RetryPolicy``
(retries throttling (429) and 5xx, honours Retry-After, backs off exponentially), a bearer token for ARM from the
coordinator's identity, and azure-core's HTTP logging (which redacts the Authorization header). Every call has a
total deadline, its retries and every byte of every answer included (adapters/deadline.py).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from azure.core import PipelineClient
from azure.core.credentials import TokenCredential
from azure.core.pipeline.policies import (
    BearerTokenCredentialPolicy,
    HeadersPolicy,
    HttpLoggingPolicy,
    RetryPolicy,
    UserAgentPolicy,
)
from azure.core.pipeline.transport import RequestsTransport
from azure.core.rest import HttpRequest, HttpResponse

from coordinator.adapters import deadline

__all__ = ["ARM_ENDPOINT", "ARM_SCOPE", "ArmClient"]

ARM_ENDPOINT = "https://management.azure.com"
ARM_SCOPE = "https://management.azure.com/.default"
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# One ARM call's total deadline, its retries included: a new VM's hybrid connection is ensured after its batch, the
# hourly housekeeping lists and deletes within a tick, and a census read pages through a resource group.
ARM_DEADLINE_SECONDS = 20.0


class ArmClient:
    """ARM with the coordinator's identity. ``endpoint``: ARM's root; a loopback ``http://`` URL is accepted for the
    emulators only. ``send`` raises azure-core's ``AzureError`` only once the retry policy gave up, and
    ``deadline.DeadlineExceeded`` past ``deadline_seconds``; any answer it did get (4xx included) is returned for the
    caller to read."""

    def __init__(
        self,
        *,
        credential: TokenCredential,
        moniker: str,
        endpoint: str = ARM_ENDPOINT,
        retry_total: int = 5,
        retry_backoff_factor: float = 0.8,
        deadline_seconds: float = ARM_DEADLINE_SECONDS,
    ) -> None:
        parts = urlsplit(endpoint)
        self._insecure_loopback = parts.scheme == "http" and parts.hostname in _LOOPBACK
        if parts.scheme != "https" and not self._insecure_loopback:
            raise ValueError(f"ARM endpoint {endpoint!r} must be https:// (http:// only on loopback for tests)")
        self._deadline = deadline_seconds
        self._client: PipelineClient[HttpRequest, HttpResponse] = PipelineClient(
            endpoint.rstrip("/"),
            transport=RequestsTransport(session=deadline.session()),
            policies=[
                HeadersPolicy({"Accept": "application/json"}),
                UserAgentPolicy(sdk_moniker=f"scheduled-events-coordinator/{moniker}"),
                # timeout: the retries' total; the deadline (in send): every byte of every attempt.
                RetryPolicy(
                    retry_total=retry_total,
                    retry_backoff_factor=retry_backoff_factor,
                    retry_backoff_max=60,
                    timeout=deadline_seconds,
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
