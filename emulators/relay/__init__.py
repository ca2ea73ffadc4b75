"""Local Azure Relay Hybrid Connections emulator (listener control channel, HTTP and WebSocket senders).

Start it with ``python -m emulators.relay --port PORT`` or from Python with :class:`RelayEmulator`.
"""

from emulators.relay.auth import RELAY_AUDIENCE, AuthError, Right, SasRule, TokenChecker, create_sas_token
from emulators.relay.emulator import RelayEmulator

__all__ = ["RELAY_AUDIENCE", "AuthError", "RelayEmulator", "Right", "SasRule", "TokenChecker", "create_sas_token"]
