"""The Relay sender fetches its token at start (``RelayApprovalSender.warm``, started by the wiring), so that the
first approval after a start does not wait for the identity endpoint; a failure there costs nothing but a log line."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from coordinator.adapters.relay_sender import RELAY_SCOPE, RelayApprovalSender
from coordinator.settings import CoordinatorSettings
from coordinator.wiring import build_approval_path


class CountingCredential:
    """A TokenCredential that counts what it is asked for (no identity endpoint here)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.scopes: list[str] = []
        self.fail = fail
        self.asked = threading.Event()

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        self.scopes.extend(scopes)
        self.asked.set()
        if self.fail:
            raise RuntimeError("the identity endpoint answered 500")
        return AccessToken("token", int(time.time()) + 3600)


def test_warm_fetches_the_relay_token() -> None:
    credential = CountingCredential()
    RelayApprovalSender(endpoint="https://ns.servicebus.windows.net", credential=credential).warm()
    assert credential.scopes == [RELAY_SCOPE]


def test_a_token_that_cannot_be_fetched_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    credential = CountingCredential(fail=True)
    sender = RelayApprovalSender(endpoint="https://ns.servicebus.windows.net", credential=credential)
    with caplog.at_level(logging.WARNING, logger="coordinator.adapters.relay_sender"):
        sender.warm()
    assert "the Relay token could not be fetched ahead of the first approval" in caplog.text
    assert "answered 500" in caplog.text


def test_the_wiring_warms_the_sender_at_start_before_any_approval() -> None:
    credential = CountingCredential()
    settings = CoordinatorSettings(
        relay_endpoint="https://ns.servicebus.windows.net", table_endpoint="https://st.table.core.windows.net"
    )
    path = build_approval_path(settings, credential, None)
    assert isinstance(path.callback, RelayApprovalSender)
    assert credential.asked.wait(5)
    assert credential.scopes == [RELAY_SCOPE]
