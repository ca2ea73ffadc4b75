"""The Functions app's identity endpoint gives azure-identity's real credentials a token naming the app's identity,
and refuses what App Service refuses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from azure.identity import DefaultAzureCredential, ManagedIdentityCredential

from emulators.app_identity import API_VERSION, AppIdentity, app_identity_id
from emulators.tokens import verify_token
from local.coordinator_setup import IDENTITY_VARIABLES

RESOURCE_ID = app_identity_id("sub-1", "rg-fleet")
OTHER_CLIENT = "00000000-0000-0000-0000-00000000000f"


@pytest.fixture
def identity(monkeypatch: pytest.MonkeyPatch) -> Iterator[AppIdentity]:
    for name in (*IDENTITY_VARIABLES, "AZURE_POD_IDENTITY_AUTHORITY_HOST"):
        monkeypatch.delenv(name, raising=False)
    with AppIdentity(RESOURCE_ID) as served:
        for name, value in served.environment().items():
            monkeypatch.setenv(name, value)
        yield served


def test_the_coordinator_s_credential_gets_a_token_naming_the_app_s_identity(identity: AppIdentity) -> None:
    # As coordinator/wiring.py builds it, with the client id the Bicep's app setting gives.
    credential = DefaultAzureCredential(managed_identity_client_id=identity.client_id)
    token = credential.get_token("https://relay.azure.net/.default")
    claims = verify_token(token.token, audience="https://relay.azure.net")
    assert claims["xms_mirid"] == RESOURCE_ID
    assert claims["oid"] == identity.principal_id
    # The credential keeps its token: one request for two asks.
    before = identity.requests
    credential.get_token("https://relay.azure.net/.default")
    assert identity.requests == before


@pytest.mark.parametrize("named_by", ["resource_id", "object_id"])
def test_a_managed_identity_credential_may_name_the_identity_otherwise(identity: AppIdentity, named_by: str) -> None:
    value = RESOURCE_ID if named_by == "resource_id" else identity.principal_id
    credential = ManagedIdentityCredential(identity_config={named_by: value})
    token = credential.get_token("https://management.azure.com/.default").token
    assert verify_token(token, audience="https://management.azure.com")["xms_mirid"] == RESOURCE_ID


@pytest.mark.parametrize(
    ("headers", "params", "status", "says"),
    [
        ({}, {"resource": "https://relay.azure.net"}, 401, "X-IDENTITY-HEADER"),
        ({"X-IDENTITY-HEADER": "guessed"}, {"resource": "https://relay.azure.net"}, 401, "X-IDENTITY-HEADER"),
        (None, {"resource": "https://relay.azure.net", "api-version": "2017-09-01"}, 400, "api-version"),
        (None, {}, 400, "resource"),
        (None, {"resource": "https://relay.azure.net", "client_id": None}, 400, "system-assigned"),
        (None, {"resource": "https://relay.azure.net", "client_id": OTHER_CLIENT}, 400, "no such"),
    ],
)
def test_what_app_service_refuses_is_refused(
    identity: AppIdentity, headers: dict[str, str] | None, params: dict[str, str | None], status: int, says: str
) -> None:
    query = {"api-version": API_VERSION, "client_id": identity.client_id, **params}
    query = {name: value for name, value in query.items() if value is not None}
    sent = {"X-IDENTITY-HEADER": identity.header} if headers is None else headers
    answer = requests.get(identity.url, params=query, headers=sent, timeout=5)
    assert answer.status_code == status
    assert answer.json()["error"] == {400: "invalid_request", 401: "unauthorized"}[status]
    assert says in answer.json()["error_description"]
    assert "access_token" not in answer.json()


def test_another_path_is_not_found(identity: AppIdentity) -> None:
    answer = requests.get(identity.url.replace("/msi/token", "/metadata/identity/oauth2/token"), timeout=5)
    assert answer.status_code == 404
    assert answer.json()["error"] == "not_found"
