"""Relay tokens: SAS signatures checked for real, Entra tokens for audience and expiry, rights per action."""

from __future__ import annotations

import asyncio

import pytest
import requests
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from emulators.relay import RelayEmulator, Right, SasRule, TokenChecker, create_sas_token
from emulators.relay.auth import AuthError, normalize_resource_uri, parse_rights
from emulators.tokens import mint_token
from tests.emulators.relay.raw import KEY, KEY_NAME, RawListener, http, sas

VM = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-a"
NS = "http://contoso.servicebus.windows.net"


def _checker(**rules: SasRule) -> TokenChecker:
    return TokenChecker(sas_rules=rules or {KEY_NAME: SasRule(KEY)})


def test_resource_uri_is_normalised_like_hyco() -> None:
    assert normalize_resource_uri("wss://ns:443/$hc/vm-a?sb-hc-action=listen") == "http://ns:443/vm-a"
    assert normalize_resource_uri("https://ns/vm-a/") == "http://ns/vm-a/"


def test_namespace_and_entity_tokens_cover_the_right_paths() -> None:
    checker = _checker()
    namespace_token = create_sas_token(NS + "/", key_name=KEY_NAME, key=KEY)
    entity_token = create_sas_token(NS + "/vm-a", key_name=KEY_NAME, key=KEY)
    for name in ("vm-a", "VM-A", "vm-b"):
        checker.authorize(namespace_token, hybrid_connection=name, right=Right.LISTEN)
    checker.authorize(entity_token, hybrid_connection="vm-a", right=Right.SEND)
    with pytest.raises(AuthError) as refused:
        checker.authorize(entity_token, hybrid_connection="vm-ab", right=Right.SEND)
    assert refused.value.status == 403
    assert "not valid for hybrid connection 'vm-ab'" in refused.value.reason


@pytest.mark.parametrize(
    ("token", "status", "reason"),
    [
        (None, 401, "no Relay token"),
        ("", 401, "no Relay token"),
        ("garbage", 401, "neither a SharedAccessSignature nor a JWT"),
        ("SharedAccessSignature sr=x&sig=y", 401, "missing se, skn"),
        ("SharedAccessSignature sr=x&sig=%%%&se=soon&skn=" + KEY_NAME, 401, "not unix seconds"),
        (create_sas_token(NS + "/vm-a", key_name="other", key=KEY), 401, "unknown key 'other'"),
        (create_sas_token(NS + "/vm-a", key_name=KEY_NAME, key="wrong-key"), 401, "signature does not match"),
        (create_sas_token(NS + "/vm-a", key_name=KEY_NAME, key=KEY, expires_in=-5), 403, "expired"),
    ],
)
def test_bad_sas_tokens_are_refused_with_the_documented_status(token: str | None, status: int, reason: str) -> None:
    with pytest.raises(AuthError) as refused:
        _checker().authorize(token, hybrid_connection="vm-a", right=Right.LISTEN)
    assert refused.value.status == status
    assert reason in refused.value.reason


def test_a_tampered_sas_token_is_refused() -> None:
    token = create_sas_token(NS + "/vm-a", key_name=KEY_NAME, key=KEY)
    tampered = token.replace("vm-a", "vm-b")
    with pytest.raises(AuthError, match="signature does not match"):
        _checker().authorize(tampered, hybrid_connection="vm-b", right=Right.LISTEN)


def test_rule_rights_are_enforced() -> None:
    checker = TokenChecker(
        sas_rules={
            "send-only": SasRule(KEY, frozenset({Right.SEND})),
            "manage": SasRule(KEY, frozenset({Right.MANAGE})),
        }
    )
    send_only = create_sas_token(NS + "/vm-a", key_name="send-only", key=KEY)
    checker.authorize(send_only, hybrid_connection="vm-a", right=Right.SEND)
    with pytest.raises(AuthError, match="does not confer the Listen right") as refused:
        checker.authorize(send_only, hybrid_connection="vm-a", right=Right.LISTEN)
    assert refused.value.status == 403
    manage = create_sas_token(NS + "/vm-a", key_name="manage", key=KEY)
    checker.authorize(manage, hybrid_connection="vm-a", right=Right.LISTEN)


def test_entra_tokens_are_checked_for_audience_expiry_and_roles() -> None:
    relay_token, expires_on = mint_token(audience="https://relay.azure.net", identity_resource_id=VM)
    grant = _checker().authorize(relay_token, hybrid_connection="vm-a", right=Right.LISTEN)
    assert (grant.subject, grant.expires_at, grant.kind) == (VM, expires_on, "entra")
    _checker().authorize("Bearer " + relay_token, hybrid_connection="vm-a", right=Right.SEND)

    wrong_audience, _ = mint_token(audience="https://eventhubs.azure.net", identity_resource_id=VM)
    with pytest.raises(AuthError, match=r"(?i)audience") as refused:
        _checker().authorize(wrong_audience, hybrid_connection="vm-a", right=Right.LISTEN)
    assert refused.value.status == 401

    expired, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=VM, lifetime_seconds=-30)
    with pytest.raises(AuthError, match="expired") as refused:
        _checker().authorize(expired, hybrid_connection="vm-a", right=Right.LISTEN)
    assert refused.value.status == 403

    forged = relay_token[:-4] + ("AAAA" if not relay_token.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthError) as refused:
        _checker().authorize(forged, hybrid_connection="vm-a", right=Right.LISTEN)
    assert refused.value.status == 401

    rbac = TokenChecker(role_assignments={VM: frozenset({Right.LISTEN})})
    rbac.authorize(relay_token, hybrid_connection="vm-a", right=Right.LISTEN)
    with pytest.raises(AuthError, match="no Azure Relay role conferring Send") as refused:
        rbac.authorize(relay_token, hybrid_connection="vm-a", right=Right.SEND)
    assert refused.value.status == 403


def test_rights_parse_and_reject_unknown_names() -> None:
    assert parse_rights("listen, Send") == {Right.LISTEN, Right.SEND}
    with pytest.raises(ValueError, match="Listen,Send,Manage"):
        parse_rights("Listen,Read")


def _handshake_status(url: str, headers: dict[str, str] | None = None) -> int:
    async def attempt() -> int:
        try:
            async with connect(url, additional_headers=headers or {}):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    return asyncio.run(attempt())


def test_listener_handshake_checks_the_token(make_relay) -> None:
    relay: RelayEmulator = make_relay(
        sas_keys={KEY_NAME: KEY, "sender": KEY}, sas_rights={"sender": frozenset({Right.SEND})}
    )
    url = relay.listen_url("vm-a")
    jwt_ok, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=VM)
    jwt_other, _ = mint_token(audience="https://management.azure.com", identity_resource_id=VM)
    assert _handshake_status(url, {"ServiceBusAuthorization": sas(relay, "vm-a")}) == 101
    assert _handshake_status(url + "&sb-hc-token=" + requests.compat.quote(sas(relay, "vm-a"), safe="")) == 101
    assert _handshake_status(url, {"ServiceBusAuthorization": jwt_ok}) == 101
    assert _handshake_status(url) == 401
    assert _handshake_status(url, {"ServiceBusAuthorization": sas(relay, "vm-a", key="bad")}) == 401
    assert _handshake_status(url, {"ServiceBusAuthorization": jwt_other}) == 401
    assert _handshake_status(url, {"ServiceBusAuthorization": sas(relay, "vm-a", ttl=-1)}) == 403
    assert _handshake_status(url, {"ServiceBusAuthorization": sas(relay, "vm-b")}) == 403
    assert _handshake_status(url, {"ServiceBusAuthorization": sas(relay, "vm-a", key_name="sender")}) == 403
    assert relay.counters()["refused.listener"] == 6
    assert relay.listener_count("vm-a") == 0


def test_http_sender_checks_the_token(make_relay) -> None:
    relay: RelayEmulator = make_relay(
        sas_keys={KEY_NAME: KEY, "listener": KEY}, sas_rights={"listener": frozenset({Right.LISTEN})}
    )
    url = relay.send_url("vm-a") + "/x"
    jwt_ok, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=VM)
    jwt_expired, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=VM, lifetime_seconds=-30)

    async def statuses() -> list[int]:
        listener = await RawListener.on(relay)

        async def serve() -> None:
            while True:
                incoming = await listener.next_request()
                await listener.respond(incoming.request["id"], 200, b"ok")

        server = asyncio.create_task(serve())
        cases = [
            {"ServiceBusAuthorization": sas(relay, "vm-a")},
            {"Authorization": sas(relay)},
            {"ServiceBusAuthorization": jwt_ok},
            {},
            {"ServiceBusAuthorization": sas(relay, "vm-a", key="nope")},
            {"ServiceBusAuthorization": jwt_expired},
            {"ServiceBusAuthorization": sas(relay, "vm-a", key_name="listener")},
            {"ServiceBusAuthorization": sas(relay, "other")},
        ]
        results = [(await http("GET", url, headers=headers)).status_code for headers in cases]
        server.cancel()
        await listener.close()
        return results

    assert asyncio.run(statuses()) == [200, 200, 200, 401, 401, 403, 403, 403]


def test_anonymous_senders_when_the_hybrid_connection_allows_them(relay: RelayEmulator) -> None:
    relay.create_hybrid_connection("public", requires_client_authorization=False)

    async def scenario() -> None:
        listener = await RawListener.on(relay, "public")
        sending = asyncio.create_task(
            http("GET", relay.send_url("public"), headers={"Authorization": "Basic end-to-end"})
        )
        incoming = await listener.next_request()
        # With relay auth off, Authorization is the application's and passes through untouched.
        assert incoming.request["requestHeaders"]["Authorization"] == "Basic end-to-end"
        await listener.respond(incoming.request["id"], 200, b"hi")
        assert (await sending).status_code == 200
        await listener.close()

    asyncio.run(scenario())
