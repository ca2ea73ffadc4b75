"""What the emulators raise to refuse a request: the HTTP status the service answers with, and its reason."""

from __future__ import annotations


class StatusError(Exception):
    """A request refused with ``status``; ``reason`` (the message) says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
