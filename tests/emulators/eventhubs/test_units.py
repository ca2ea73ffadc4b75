"""The emulator's pure parts: frame padding, SAS/JWT validation, addresses and selectors, batch unpacking,
the on-disk log."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import pytest
from azure.eventhub._pyamqp._decode import decode_frame
from azure.eventhub._pyamqp.utils import generate_sas_token
from proton import Data, Message, symbol

from emulators.eventhubs import messages
from emulators.eventhubs.addresses import (
    AddressError,
    PositionField,
    parse_consume_source,
    parse_publish_target,
    parse_selector,
)
from emulators.eventhubs.auth import AuthError, validate_jwt, validate_sas_token, validate_token
from emulators.eventhubs.framing import FramePadder, pad_frame
from emulators.eventhubs.partition_log import PartitionLog
from emulators.tokens import mint_token

KEY = "unit-test-key"


def _frame(performative: bytes, payload: bytes = b"", channel: int = 0) -> bytes:
    body = performative + payload
    return struct.pack(">IBBH", 8 + len(body), 2, 0, channel) + body


def test_a_short_begin_is_padded_so_pyamqp_can_read_every_field() -> None:
    # begin with 5 of its 8 fields, as proton writes it: remote-channel, next-outgoing-id, windows, handle-max
    fields = b"\x60\x00\x01" + b"\x43" + b"\x70\x7f\xff\xff\xff" * 2 + b"\x70\x00\x00\x00\x07"
    short = _frame(b"\x00\x53\x11\xc0" + bytes((len(fields) + 1, 5)) + fields)
    padded = pad_frame(short)
    frame_type, decoded = decode_frame(memoryview(padded)[8:])
    assert frame_type == 0x11
    assert len(decoded) == 8
    assert decoded[0] == 1
    assert decoded[4] == 7
    assert decoded[5:] == [None, None, None]


def test_a_transfer_keeps_its_payload_after_padding() -> None:
    fields = b"\x43\x43\xa0\x01\x31"  # handle 0, delivery-id 0, tag b"1"
    payload = b"\x00\x53\x75\xa0\x05hello"
    short = _frame(b"\x00\x53\x14\xc0" + bytes((len(fields) + 1, 3)) + fields, payload)
    _, decoded = decode_frame(memoryview(pad_frame(short))[8:])
    assert len(decoded) == 12  # 11 fields + the payload pyamqp appends at index 11
    assert bytes(decoded[11]) == payload


def test_list0_and_full_lists_and_heartbeats() -> None:
    end = _frame(b"\x00\x53\x17\x45")
    assert decode_frame(memoryview(pad_frame(end))[8:]) == (0x17, [None])
    heartbeat = struct.pack(">IBBH", 8, 2, 0, 0)
    assert pad_frame(heartbeat) == heartbeat
    full_close = _frame(b"\x00\x53\x18\xc0\x02\x01\x40")
    assert pad_frame(full_close) == full_close


def test_the_padder_passes_headers_and_holds_partial_frames() -> None:
    padder = FramePadder()
    end = _frame(b"\x00\x53\x17\x45")
    stream = b"AMQP\x00\x01\x00\x00" + end
    assert padder.feed(stream[:10]) == b"AMQP\x00\x01\x00\x00"
    assert padder.feed(stream[10:]) == pad_frame(end)


def _sas(resource: str, *, key: str = KEY, key_name: str = "root", expiry: int | None = None) -> str:
    return str(generate_sas_token(resource, key_name, key, expiry or int(time.time()) + 600))  # type: ignore[no-untyped-call]


def test_a_sas_token_signed_with_the_key_is_accepted_and_scoped_to_its_resource() -> None:
    grant = validate_sas_token(_sas("sb://127.0.0.1:5672/Hub"), key_name="root", key=KEY)
    assert grant.path == "hub"
    assert grant.covers("hub")
    assert grant.covers("HUB/Partitions/1")
    assert not grant.covers("other-hub")
    namespace = validate_sas_token(_sas("sb://127.0.0.1:5672"), key_name="root", key=KEY)
    assert namespace.covers("anything/ConsumerGroups/$Default/Partitions/0")


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (_sas("sb://h/hub", key="other"), "signature does not match"),
        (_sas("sb://h/hub", key_name="guest"), "guest"),
        (_sas("sb://h/hub", expiry=int(time.time()) - 1), "expired"),
        ("Bearer abc", "must start with"),
        ("SharedAccessSignature sr=x&se=1", "lacks sig, skn"),
        (f"SharedAccessSignature sr={quote_plus('sb://h/hub')}&sig=x&se=soon&skn=root", "not an integer"),
    ],
)
def test_bad_sas_tokens_are_refused_with_the_reason(token: str, reason: str) -> None:
    with pytest.raises(AuthError, match=reason):
        validate_sas_token(token, key_name="root", key=KEY)


def test_entra_tokens_need_the_event_hubs_audience() -> None:
    good, _ = mint_token(audience="https://eventhubs.azure.net", identity_resource_id="/subscriptions/s/vm1")
    assert validate_jwt(good).covers("any-hub")
    wrong, _ = mint_token(audience="https://relay.azure.net", identity_resource_id="/subscriptions/s/vm1")
    with pytest.raises(AuthError, match="access token refused"):
        validate_jwt(wrong)
    with pytest.raises(AuthError, match="unsupported CBS token type"):
        validate_token(good, "x509", key_name="root", key=KEY)


def test_link_addresses() -> None:
    assert parse_publish_target("amqp://127.0.0.1:1/hub").model_dump() == {"hub": "hub", "partition": None}
    assert parse_publish_target("amqps://h/hub/Partitions/3").partition == "3"
    source = parse_consume_source("amqps://h:1/hub/ConsumerGroups/$Default/Partitions/2")
    assert (source.hub, source.consumer_group, source.partition) == ("hub", "$Default", "2")
    with pytest.raises(AddressError, match="hub/x/y/z"):
        parse_publish_target("hub/x/y/z")
    with pytest.raises(AddressError, match="ConsumerGroups"):
        parse_consume_source("amqps://h/hub/Partitions/2")


def test_selectors() -> None:
    assert parse_selector(None).value == -1
    assert parse_selector("amqp.annotation.x-opt-offset > '-1'").model_dump() == {
        "field": PositionField.OFFSET,
        "value": -1,
        "inclusive": False,
        "latest": False,
    }
    assert parse_selector("amqp.annotation.x-opt-offset > '@latest'").latest
    by_sequence = parse_selector("amqp.annotation.x-opt-sequence-number >= '42'")
    assert (by_sequence.field, by_sequence.value, by_sequence.inclusive) == (PositionField.SEQUENCE_NUMBER, 42, True)
    assert parse_selector("amqp.annotation.x-opt-enqueued-time > '1700000000000'").value == 1700000000000
    for bad in ("amqp.annotation.x-opt-offset < '5'", "amqp.annotation.x-opt-offset > 'five'", "1 = 1"):
        with pytest.raises(AddressError, match="selector filter"):
            parse_selector(bad)


def _batch(*events: Message, outer_key: str | None = None) -> bytes:
    data = Data()
    if outer_key is not None:
        data.put_described()
        data.enter()
        data.put_ulong(0x72)
        data.put_dict({symbol("x-opt-partition-key"): outer_key})
        data.exit()
    for event in events:
        data.put_described()
        data.enter()
        data.put_ulong(0x75)
        data.put_binary(event.encode())
        data.exit()
    return bytes(data.encode())


def test_a_batch_is_unpacked_into_its_events_and_a_single_event_is_not() -> None:
    one, two = Message(body=b'{"n":1}', properties={"k": 1}), Message(body=b'{"n":2}')
    events = messages.unpack(_batch(one, two, outer_key="vm-9"))
    decoded = [messages.decode(raw) for raw, _ in events]  # kept alive: a binary body is a view into it
    bodies: list[Any] = [message.body for message in decoded]
    assert [bytes(body) for body in bodies] == [b'{"n":1}', b'{"n":2}']
    assert [key for _, key in events] == ["vm-9", "vm-9"]
    assert messages.decode(events[0][0]).properties == {"k": 1}
    single = Message(body=b'{"not": "a batch"}').encode()
    assert messages.unpack(single) == [(single, None)]
    with pytest.raises(messages.MessageError, match="undecodable"):
        messages.unpack(b"\x00\x53\x75\xb0\x00\x00\xff\xff")


def test_the_log_keeps_order_and_sets_a_torn_tail_aside(tmp_path: Path) -> None:
    path = tmp_path / "hub" / "0.log"
    log = PartitionLog(hub="hub", partition_id="0", path=path)
    log.append([(b"m0", "k"), (b"m1", "k")], now_ms=1000)
    log.append([(b"m2", None)], now_ms=900)  # a clock step back must not make time go backwards
    with path.open("ab") as handle:
        handle.write(b'\x00\x00\x00\x30{"seq": 3')  # a crash in the middle of a record
    reopened = PartitionLog(hub="hub", partition_id="0", path=path)
    assert [(e.sequence_number, e.message, e.partition_key) for e in reopened.snapshot()] == [
        (0, b"m0", "k"),
        (1, b"m1", "k"),
        (2, b"m2", None),
    ]
    assert [e.enqueued_time_ms for e in reopened.snapshot()] == [1000, 1000, 1000]
    assert path.with_suffix(".torn").read_bytes().startswith(b"\x00\x00\x00\x30")
    assert reopened.append([(b"m3", None)], now_ms=2000)[0].sequence_number == 3


def test_a_position_admits_only_later_events() -> None:
    after_seven = parse_selector("amqp.annotation.x-opt-sequence-number > '7'")
    assert not after_seven.admits(offset=999, sequence_number=7, enqueued_time_ms=0)
    assert after_seven.admits(offset=0, sequence_number=8, enqueued_time_ms=0)
    from_time = parse_selector("amqp.annotation.x-opt-enqueued-time >= '5000'")
    assert from_time.admits(offset=0, sequence_number=0, enqueued_time_ms=5000)
    assert not from_time.admits(offset=0, sequence_number=99, enqueued_time_ms=4999)
