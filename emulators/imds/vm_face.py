"""What a VM reads from IMDS: Scheduled Events (and its StartRequests), instance metadata, attested documents and
managed-identity tokens, each under its documented api-versions and with the faults injected for it; and the PKI
the attested documents chain to."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import ValidationError

from emulators.imds.attested import (
    ISSUER_PATH,
    ROOT_PATH,
    NonceError,
)
from emulators.imds.emulator_core import EmulatorCore
from emulators.imds.faults import Endpoint, FaultDecision
from emulators.imds.models import StartRequestsBody, describe_validation_error
from emulators.imds.records import EmulatorInputError
from emulators.imds.versions import (
    ATTESTED_VERSIONS,
    IDENTITY_VERSIONS,
    INSTANCE_VERSIONS,
    SCHEDULED_EVENTS_VERSIONS,
    newest,
)
from emulators.imds.vm_models import VmSpec
from emulators.imds.wire import JSON, Reply, RequestHandler, bad_request
from emulators.tokens import mint_token

TOKEN_LIFETIME_SECONDS = 3600


class VmFace(EmulatorCore):
    """The endpoints a VM calls (``/metadata/...``), after the fault the plan decided for the request."""

    def _carry_out(self, decision: FaultDecision) -> None:
        if decision.throttled:
            raise Reply(429, {"error": "Too many requests"})
        for seconds in (decision.delay_seconds, decision.hang_seconds):
            if seconds > 0 and self._stopping.wait(seconds):
                raise Reply(503, {"error": "Service unavailable"})
        if decision.error_status is not None:
            raise Reply(decision.error_status, {"error": "Internal server error"})

    @staticmethod
    def _api_version(query: dict[str, list[str]], known: tuple[str, ...]) -> str:
        versions = query.get("api-version")
        if not versions or not versions[0]:
            raise Reply(
                400,
                {
                    "error": "Bad request. api-version was not specified in the request. "
                    "For more information refer to aka.ms/azureimds",
                    "newest-versions": newest(known),
                },
            )
        if versions[0] not in known:
            raise Reply(
                400,
                {
                    "error": "Bad request. api-version is invalid or was not specified in the request. "
                    "For more information refer to aka.ms/azureimds",
                    "newest-versions": newest(known),
                },
            )
        return versions[0]

    def _scheduled_events(
        self, method: str, vm_name: str, query: dict[str, list[str]], handler: RequestHandler, *, whole: bool
    ) -> tuple[int, dict[str, Any] | None]:
        version = self._api_version(query, SCHEDULED_EVENTS_VERSIONS)
        if method == "GET":
            with self._lock:
                # A garbled answer (malformed-json fault) is not a document the client could read.
                return 200, self.state.document(vm_name, version, self.clock.now(), served=whole)
        if method != "POST":
            raise Reply(405, {"error": "Method not allowed"})
        raw = handler.read_body()
        try:
            body = StartRequestsBody.model_validate_json(raw)
        except ValidationError as error:
            raise bad_request(describe_validation_error(error, source="StartRequests body")) from error
        with self._lock:
            try:
                self.state.approve(vm_name, body, self.clock.now())
            except EmulatorInputError as error:
                raise bad_request(str(error)) from error
        return 200, None

    def _instance(
        self, method: str, vm_name: str, path: str, query: dict[str, list[str]], decision: FaultDecision
    ) -> tuple[int, bytes, str]:
        if method != "GET":
            raise Reply(405, {"error": "Method not allowed"})
        self._api_version(query, INSTANCE_VERSIONS)
        vm = self.state.vms[vm_name]
        node: Any = {"compute": vm.compute(), "network": _network(vm)}
        for key in path.removeprefix("/metadata/instance").strip("/").split("/"):
            if not key:
                continue
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise Reply(404, {"error": "Not found"})
        output = (query.get("format") or ["json"])[0]
        if not isinstance(node, dict | list):
            if output != "text":
                raise bad_request("Query parameter 'format=text' is required for leaf nodes")
            return 200, str(node).encode(), "text/plain; charset=utf-8"
        text = json.dumps(node)
        if decision.malformed:
            text = text[: max(1, len(text) // 2)]
        return 200, text.encode(), JSON

    def _pki(self, method: str, path: str) -> tuple[int, bytes, str]:
        if method != "GET":
            raise Reply(405, {"error": "Method not allowed"})
        if path == ISSUER_PATH:
            # What the signing certificate's CA Issuers URL names (DER, as Microsoft's PKI serves .crt files).
            return 200, self.attested.authority.issuer_der, "application/pkix-cert"
        if path == ROOT_PATH:
            return 200, self.root_pem, "application/x-pem-file"
        raise Reply(404, {"error": f"no PKI route {path}"})

    def _attested_document(self, method: str, vm_name: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            raise Reply(405, {"error": "Method not allowed"})
        self._api_version(query, ATTESTED_VERSIONS)
        nonces = query.get("nonce")
        if nonces is not None and len(nonces) > 1:
            raise bad_request("Requests with duplicate query parameter names are not accepted")
        with self._lock:
            vm = self.state.vms[vm_name].compute()
            now = self.clock.now()
        try:
            return 200, self.attested.document(vm, nonce=nonces[0] if nonces else None, now=now)
        except NonceError as error:
            raise bad_request(str(error)) from error

    def _token(self, method: str, vm_name: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            raise Reply(405, {"error": "Method not allowed"})
        self._api_version(query, IDENTITY_VERSIONS)
        resource = (query.get("resource") or [""])[0]
        if not resource:
            raise Reply(
                400, {"error": "invalid_request", "error_description": "Required audience parameter not specified"}
            )
        vm = self.state.vms[vm_name]
        for parameter, expected in (("client_id", vm.client_id), ("msi_res_id", vm.resourceId)):
            given = (query.get(parameter) or [""])[0]
            if given and given.lower() != expected.lower():
                raise Reply(400, {"error": "invalid_request", "error_description": "Identity not found"})
        token, expires_on = mint_token(
            audience=resource, identity_resource_id=vm.resourceId, lifetime_seconds=TOKEN_LIFETIME_SECONDS
        )
        now = int(time.time())
        return 200, {
            "access_token": token,
            "client_id": vm.client_id,
            "expires_in": str(expires_on - now),
            "expires_on": str(expires_on),
            "ext_expires_in": str(expires_on - now),
            "not_before": str(now),
            "resource": resource,
            "token_type": "Bearer",
        }


def endpoint_of(path: str) -> Endpoint | None:
    if path == "/metadata/scheduledevents":
        return "scheduledevents"
    if path == "/metadata/instance" or path.startswith("/metadata/instance/"):
        return "instance"
    if path == "/metadata/identity/oauth2/token":
        return "identity"
    if path == "/metadata/attested/document":
        return "attested"
    return None


def _network(vm: VmSpec) -> dict[str, Any]:
    octet = sum(vm.vmId.encode()) % 250 + 4
    return {
        "interface": [
            {
                "ipv4": {
                    "ipAddress": [{"privateIpAddress": f"10.0.0.{octet}", "publicIpAddress": ""}],
                    "subnet": [{"address": "10.0.0.0", "prefix": "24"}],
                },
                "ipv6": {"ipAddress": []},
                "macAddress": f"000D3A{octet:06X}",
            }
        ]
    }
