"""Relay emulators on free loopback ports, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from emulators.relay import RelayEmulator
from tests.emulators.relay.raw import KEY, KEY_NAME


@pytest.fixture
def make_relay() -> Iterator[Callable[..., RelayEmulator]]:
    with ExitStack() as started:

        def make(**options: Any) -> RelayEmulator:
            options.setdefault("sas_keys", {KEY_NAME: KEY})
            return started.enter_context(RelayEmulator(**options))

        yield make


@pytest.fixture
def relay(make_relay: Callable[..., RelayEmulator]) -> RelayEmulator:
    return make_relay(response_timeout=5.0)
