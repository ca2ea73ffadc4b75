"""The emulators' Entra-shaped tokens are checked for audience and expiry, as Azure checks real ones."""

from __future__ import annotations

import pytest

from emulators.tokens import TokenError, mint_token, verify_token

VM_ID = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm0"


def test_a_token_for_the_right_audience_is_accepted() -> None:
    token, expires_on = mint_token(audience="https://relay.azure.net", identity_resource_id=VM_ID)
    claims = verify_token(token, audience="https://relay.azure.net/")
    assert claims["xms_mirid"] == VM_ID
    assert claims["exp"] == expires_on


def test_a_token_for_another_audience_is_refused() -> None:
    token, _ = mint_token(audience="https://eventhubs.azure.net", identity_resource_id=VM_ID)
    with pytest.raises(TokenError, match=r"(?i)audience"):
        verify_token(token, audience="https://relay.azure.net")


def test_an_expired_or_tampered_token_is_refused() -> None:
    expired, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=VM_ID, lifetime_seconds=-10)
    with pytest.raises(TokenError, match="expired"):
        verify_token(expired, audience="https://relay.azure.net")
    good, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=VM_ID)
    with pytest.raises(TokenError):
        verify_token(good[:-2] + "xx", audience="https://relay.azure.net")
