"""Pads outgoing AMQP performatives to their full field count.

proton (like the AMQP 1.0 spec allows) leaves trailing null fields out of a performative's list. The pure-Python
AMQP client inside azure-eventhub (``_pyamqp``) reads fields by position instead — ``begin`` field 7, ``attach``
field 13, a ``transfer``'s payload at index 11 — and fails with ``IndexError`` on the shorter lists. The real
service writes every field, so this shim rewrites proton's output the same way: the list header is re-encoded
with the full count and explicit nulls (0x40) are appended. Nothing else in a frame is touched.
"""

from __future__ import annotations

import struct

# Field counts from the AMQP 1.0 specification (part 2.7 transport performatives, part 5.3 SASL frames).
_FIELD_COUNT: dict[int, int] = {
    0x10: 10,  # open
    0x11: 8,  # begin
    0x12: 14,  # attach
    0x13: 11,  # flow
    0x14: 11,  # transfer
    0x15: 6,  # disposition
    0x16: 3,  # detach
    0x17: 1,  # end
    0x18: 1,  # close
    0x40: 1,  # sasl-mechanisms
    0x41: 3,  # sasl-init
    0x42: 1,  # sasl-challenge
    0x43: 1,  # sasl-response
    0x44: 2,  # sasl-outcome
}
_PROTOCOL_HEADER_SIZE = 8
_FRAME_HEADER_SIZE = 8
_NULL = b"\x40"


class FramingError(ValueError):
    """The outgoing byte stream is not AMQP framing this shim understands."""


def pad_frame(frame: bytes) -> bytes:
    """Returns ``frame`` with its performative list padded to the full field count (unchanged if already full)."""
    data_offset = frame[4] * 4
    body = frame[data_offset:]
    if not body:  # heartbeat (empty frame)
        return frame
    if body[0] != 0x00:
        raise FramingError(f"frame body does not start with a described type: {body[:4].hex()}")
    if body[1] == 0x53:  # smallulong descriptor
        code, index = body[2], 3
    elif body[1] == 0x80:  # ulong descriptor
        code, index = int.from_bytes(body[2:10], "big"), 10
    else:
        raise FramingError(f"unsupported performative descriptor constructor 0x{body[1]:02x}")
    wanted = _FIELD_COUNT.get(code)
    if wanted is None:
        return frame
    count, fields_start, fields_end = _list_bounds(body, index, code)
    if count >= wanted:
        return frame
    fields = body[fields_start:fields_end] + _NULL * (wanted - count)
    if len(fields) + 1 <= 0xFF:
        header = bytes((0xC0, len(fields) + 1, wanted))
    else:
        header = b"\xd0" + struct.pack(">II", len(fields) + 4, wanted)
    new_body = body[:index] + header + fields + body[fields_end:]
    return struct.pack(">I", data_offset + len(new_body)) + frame[4:data_offset] + new_body


def _list_bounds(body: bytes, index: int, code: int) -> tuple[int, int, int]:
    """(field count, first field byte, end) of the list encoded at ``body[index]``."""
    constructor = body[index]
    if constructor == 0x45:  # list0
        return 0, index + 1, index + 1
    if constructor == 0xC0:  # list8: size, count
        size, count = body[index + 1], body[index + 2]
        return count, index + 3, index + 2 + size
    if constructor == 0xD0:  # list32: size, count
        size, count = struct.unpack(">II", body[index + 1 : index + 9])
        return count, index + 9, index + 5 + size
    raise FramingError(f"performative 0x{code:02x} is not a list (constructor 0x{constructor:02x})")


class FramePadder:
    """Stateful filter over a connection's outgoing byte stream: protocol headers pass, frames get padded."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, data: bytes) -> bytes:
        """Takes the next bytes proton produced; returns the complete frames (padded) ready for the socket."""
        self._pending += data
        out = bytearray()
        pending = self._pending
        while len(pending) >= _PROTOCOL_HEADER_SIZE:
            if pending[:4] == b"AMQP":
                out += pending[:_PROTOCOL_HEADER_SIZE]
                del pending[:_PROTOCOL_HEADER_SIZE]
                continue
            size = int.from_bytes(pending[:4], "big")
            if size < _FRAME_HEADER_SIZE:
                raise FramingError(f"frame size {size} is smaller than a frame header")
            if len(pending) < size:
                break
            out += pad_frame(bytes(pending[:size]))
            del pending[:size]
        return bytes(out)
