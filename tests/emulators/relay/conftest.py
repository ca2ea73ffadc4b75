"""Relay emulators on free loopback ports, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from emulators.relay import RelayEmulator
from tests.emulators.relay.raw import KEY, KEY_NAME


@pytest.fixture
def make_relay() -> Iterator[Callable[..., RelayEmulator]]:
    started: list[RelayEmulator] = []

    def make(**options: Any) -> RelayEmulator:
        options.setdefault("sas_keys", {KEY_NAME: KEY})
        relay = RelayEmulator(**options)
        relay.start()
        started.append(relay)
        return relay

    yield make
    for relay in started:
        relay.stop()


@pytest.fixture
def relay(make_relay: Callable[..., RelayEmulator]) -> RelayEmulator:
    return make_relay(response_timeout=5.0)
