"""Unpacking what a producer sends: a single event, or a batch (message format 0x80013700) of events.

A batch is one AMQP message whose body is a series of data sections, each holding one complete encoded event
message. proton's Python binding does not expose a transfer's message-format field, so a batch is recognised by
its content: every body section is a data section that itself starts with an AMQP message section descriptor
(0x00 0x53 0x70..0x77). A single event's own data body (JSON, text) never starts with those bytes.
"""

from __future__ import annotations

from typing import Any

from proton import Data, Message, ProtonException, symbol

PARTITION_KEY = symbol("x-opt-partition-key")
_DATA_SECTION, _SEQUENCE_SECTION, _VALUE_SECTION = 0x75, 0x76, 0x77
_FIRST_SECTION, _LAST_SECTION = 0x70, 0x77


class MessageError(ValueError):
    """The transfer is not a decodable AMQP message; the message says what is wrong."""


def _sections(payload: bytes) -> list[tuple[int, Any]]:
    sections: list[tuple[int, Any]] = []
    view = memoryview(payload)
    while view:
        data = Data()
        try:
            consumed = data.decode(bytes(view))
        except ProtonException as error:
            raise MessageError(f"undecodable AMQP section at byte {len(payload) - len(view)}: {error}") from error
        if consumed <= 0:
            raise MessageError(f"undecodable AMQP section at byte {len(payload) - len(view)}")
        data.rewind()
        data.next()
        if not data.is_described():
            raise MessageError(f"AMQP section at byte {len(payload) - len(view)} is not a described type")
        data.enter()
        data.next()
        descriptor = data.get_object()
        data.next()
        value = data.get_object()
        # A binary comes back as a view into proton's buffer, which dies with ``data``: copy it now.
        if isinstance(value, memoryview):
            value = value.tobytes()
        sections.append((int(descriptor or 0), value))
        view = view[consumed:]
    return sections


def _looks_like_message(body: bytes) -> bool:
    return len(body) >= 3 and body[0] == 0x00 and body[1] == 0x53 and _FIRST_SECTION <= body[2] <= _LAST_SECTION


def decode(payload: bytes) -> Message:
    message = Message()
    try:
        message.decode(payload)
    except ProtonException as error:
        raise MessageError(f"undecodable AMQP message ({len(payload)} bytes): {error}") from error
    return message


def partition_key_of(message: Message) -> str | None:
    annotations: dict[Any, Any] = dict(message.annotations or {})
    key = annotations.get(PARTITION_KEY)
    return None if key is None else str(key)


def unpack(payload: bytes) -> list[tuple[bytes, str | None]]:
    """Returns each event's encoded message with its partition key; a batch's key is inherited by its events."""
    outer = decode(payload)
    outer_key = partition_key_of(outer)
    sections = _sections(payload)
    bodies = [value for code, value in sections if code == _DATA_SECTION]
    has_other_body = any(code in (_SEQUENCE_SECTION, _VALUE_SECTION) for code, _ in sections)
    is_batch = bool(bodies) and not has_other_body and all(_looks_like_message(body) for body in bodies)
    if not is_batch:
        return [(payload, outer_key)]
    events: list[tuple[bytes, str | None]] = []
    for index, body in enumerate(bodies):
        try:
            inner = decode(body)
        except MessageError as error:
            raise MessageError(f"batch event {index}: {error}") from error
        events.append((body, partition_key_of(inner) or outer_key))
    return events
