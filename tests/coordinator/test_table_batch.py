"""coordinator/state/table_batch.py: the ``$batch`` transport must be the SDK's ``submit_transaction`` on the wire and
in what it raises. Fast: each operation's request is the one the SDK's builders make; an answer is read part by part.
On Azurite: the same transactions through the SDK and through this transport leave the same table and raise the
same exceptions, and the store keeps its behaviour on either (a refused ETag is a conflict, an oversized entity
RecordTooLarge).
"""

from __future__ import annotations

import email
import email.policy
import json
import uuid
from typing import Any

import pytest
from azure.core import MatchConditions
from azure.data.tables import TableClient, TableServiceClient, TableTransactionError, UpdateMode
from azure.data.tables._table_batch import TableBatchOperations

from coordinator.adapters import deadline
from coordinator.state.entities import Write, event_entity, event_partition
from coordinator.state.store import ConcurrencyConflict, RecordTooLarge
from coordinator.state.table_batch import TransactionTableClient, answer_parts, batch_body, requests_of
from coordinator.state.tables import TableStateStore
from tests.coordinator.helpers import event_record

BASE = "http://127.0.0.1:10002/devstoreaccount1"
ETAG = "W/\"datetime'2026-11-28T21%3A46%3A53.2551364Z'\""
ENTITY = {"PartitionKey": "p'1", "RowKey": "r é/1", "N": 1, "S": "h\u00e9llo \U0001f600", "B": b"\x00", "F": 1.5}
IF_MATCH = MatchConditions.IfNotModified
OPERATIONS: list[Any] = [
    ("create", ENTITY),
    ("update", ENTITY, {"mode": UpdateMode.REPLACE, "etag": ETAG, "match_condition": IF_MATCH}),
    ("update", ENTITY, {"mode": UpdateMode.MERGE, "etag": ETAG, "match_condition": IF_MATCH}),
    ("update", ENTITY),
    ("upsert", ENTITY),
    ("upsert", ENTITY, {"mode": UpdateMode.REPLACE}),
    ("delete", {"PartitionKey": "p'1", "RowKey": "gone"}),
    ("delete", {"PartitionKey": "p'1", "RowKey": "gone"}, {"etag": ETAG, "match_condition": IF_MATCH}),
]


def sent(body: bytes, boundary: str) -> list[tuple[str, str, dict[str, str], Any]]:
    """Each request of a $batch body (read with the stdlib's MIME parser): method, URL, headers, JSON body."""
    top = email.message_from_bytes(
        f"Content-Type: multipart/mixed; boundary={boundary}\r\n\r\n".encode() + body, policy=email.policy.HTTP
    )
    payload: Any = top.get_payload()
    changeset = payload[0]
    out = []
    for index, part in enumerate(changeset.get_payload()):
        assert part["Content-ID"] == str(index)
        assert part["Content-Type"] == "application/http"
        assert part["Content-Transfer-Encoding"] == "binary"
        head, _, content = part.get_payload().partition("\r\n\r\n")
        line, *lines = head.split("\r\n")
        method, url, _ = line.split(" ")
        headers = dict(h.split(": ", 1) for h in lines)
        assert headers.pop("x-ms-date") == headers.pop("Date")
        if content:
            assert int(headers["Content-Length"]) == len(content.encode())
        out.append((method, url, headers, json.loads(content) if content else None))
    return out


def test_each_operation_is_the_request_the_sdks_builders_make() -> None:
    class Config:
        version = "2019-02-02"

    sdk = TableBatchOperations(config=Config(), endpoint=BASE, table_name="tab")  # type: ignore[arg-type]
    for operation in OPERATIONS:
        sdk.add_operation(operation)
    expected = [
        (r.method, r.url, {k: v for k, v in r.headers.items()}, json.loads(r.content) if r.content else None)
        for r in sdk.requests
    ]
    body = batch_body(requests_of(OPERATIONS, base=BASE, table="tab", version="2019-02-02"), batch="b1", changeset="c1")

    assert sent(body, "b1") == expected
    assert body.endswith(b"--c1--\r\n\r\n--b1--\r\n")


def test_what_the_sdk_refuses_is_refused_alike() -> None:
    def refusal(operations: list[Any]) -> tuple[type[Exception], str]:
        with pytest.raises((ValueError, TypeError)) as raised:
            requests_of(operations, base=BASE, table="tab", version="2019-02-02")
        return type(raised.value), str(raised.value)

    two = [("create", {"PartitionKey": "a", "RowKey": "1"}), ("create", {"PartitionKey": "b", "RowKey": "1"})]
    assert refusal(two) == (ValueError, "Partition Keys in the batch must all be the same.")
    assert refusal([("frob", ENTITY)]) == (ValueError, "Unrecognized operation: frob")
    assert refusal([("create", {"PartitionKey": "a"})])[0] is ValueError
    assert refusal([("create", {**ENTITY, "L": 2**40})])[0] is TypeError  # an int beyond Int32, as the SDK
    assert refusal([("update", ENTITY, {"match_condition": MatchConditions.IfNotModified})])[0] is ValueError


def test_an_empty_transaction_sends_nothing_and_answers_nothing() -> None:
    # Azure answers an empty changeset 400, which the SDK answers []; nothing listens on port 9.
    client = TransactionTableClient.from_connection_string(
        "DefaultEndpointsProtocol=http;AccountName=a;AccountKey=a2V5;TableEndpoint=http://127.0.0.1:9/a;",
        table_name="tab",
        retry_total=0,
    )
    assert client.submit_transaction([]) == []


ANSWER = (
    b"--batchresponse_1\r\nContent-Type: multipart/mixed; boundary=changesetresponse_2\r\n\r\n"
    b"--changesetresponse_2\r\nContent-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n\r\n"
    b"HTTP/1.1 201 Created\r\nDataServiceVersion: 3.0;\r\nETag: W/\"datetime'1'\"\r\n\r\n\r\n"
    b"--changesetresponse_2\r\nContent-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n\r\n"
    b"HTTP/1.1 204 No Content\r\nETag: W/\"datetime'2'\"\r\n\r\n\r\n"
    b"--changesetresponse_2\r\nContent-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n\r\n"
    b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json;odata=minimalmetadata;charset=utf-8\r\n\r\n"
    b'{"odata.error":{"code":"EntityAlreadyExists","message":{"lang":"en-US","value":"2:exists"}}}\r\n'
    b"--changesetresponse_2--\r\n--batchresponse_1--\r\n"
)


def test_an_answer_is_read_part_by_part() -> None:
    parts = answer_parts("multipart/mixed; boundary=batchresponse_1", ANSWER)

    assert [(p.status_code, p.reason) for p in parts] == [(201, "Created"), (204, "No Content"), (409, "Conflict")]
    assert [p.headers.get("etag") for p in parts] == ["W/\"datetime'1'\"", "W/\"datetime'2'\"", None]
    assert json.loads(parts[2].text())["odata.error"]["code"] == "EntityAlreadyExists"
    assert parts[2].content_type == "application/json;odata=minimalmetadata;charset=utf-8"


# On Azurite --------------------------------------------------------------------------------------------------------
def outcome(table: TableClient, operations: list[Any]) -> Any:
    try:
        return [sorted(result) for result in table.submit_transaction(operations)]
    except (TableTransactionError, ValueError, TypeError) as error:
        first_line = str(error).split("\n")[0].split("RequestId")[0]
        return (type(error).__name__, getattr(error, "status_code", None), getattr(error, "error_code", None),
                getattr(error, "index", None), first_line)  # fmt: skip


def state(table: TableClient) -> list[dict[str, Any]]:
    return sorted((dict(e) for e in table.list_entities()), key=lambda e: (e["PartitionKey"], e["RowKey"]))


def scenario(table: TableClient) -> list[Any]:
    """Transactions that succeed and fail in each way the coordinator meets: the outcome of each."""

    def row(key: str, partition: str = "part", **properties: Any) -> dict[str, Any]:
        return {"PartitionKey": partition, "RowKey": key, **properties}

    made = [outcome(table, [("create", row(f"r{n}", N=n)) for n in range(5)])]
    etag: dict[str, Any] = {"etag": table.get_entity("part", "r2").metadata["etag"], "match_condition": IF_MATCH}
    stale: dict[str, Any] = {"etag": table.get_entity("part", "r3").metadata["etag"], "match_condition": IF_MATCH}
    table.update_entity(row("r3", N=30), **stale)
    made += [
        # a taken claim at index k: the whole transaction refused, k named
        outcome(table, [("create", row("new")), ("create", row("r1"))]),
        # an ETag conflict at index 1 (the deciding write's)
        outcome(table, [("update", row("r2", N=20), etag), ("update", row("r3", N=31), {"mode": "replace", **stale})]),
        # an entity too large for the table (a property over 64 KiB)
        outcome(table, [("create", row("big", D="x" * 40_000))]),
        # a delete of an entity gone: refused whole
        outcome(table, [("delete", row("r0")), ("delete", row("none"))]),
        outcome(table, [("create", row("x")), ("create", row("x", "other"))]),
        # and what commits: a conditional merge, upserts, a delete
        outcome(
            table,
            [
                ("update", row("r2", M="m"), etag),
                ("upsert", row("u", S="é")),
                ("upsert", row("r4"), {"mode": UpdateMode.REPLACE}),
                ("delete", row("r0")),
            ],
        ),
    ]
    return made


def test_the_sdk_and_this_transport_leave_the_same_table_and_raise_the_same(azurite: Any) -> None:
    service = TableServiceClient.from_connection_string(azurite.connection_string)
    names = [f"batch{kind}{uuid.uuid4().hex[:10]}" for kind in ("sdk", "own")]
    for name in names:
        service.create_table(name)
    sdk = service.get_table_client(names[0])
    own = TransactionTableClient.from_connection_string(azurite.connection_string, table_name=names[1])

    expected = scenario(sdk)
    assert scenario(own) == expected
    assert state(own) == state(sdk)
    assert expected[1][:4] == ("TableTransactionError", 409, "EntityAlreadyExists", 1)
    assert expected[2][:4] == ("TableTransactionError", 412, "UpdateConditionNotSatisfied", 1)
    assert expected[3][:4] == ("TableTransactionError", 400, "PropertyValueTooLarge", 0)
    assert expected[4][:4] == ("TableTransactionError", 404, "ResourceNotFound", 1)
    assert len(expected[6]) == 4
    assert all(result == ["etag"] for result in expected[6][:3])


@pytest.fixture(params=["sdk", "own", "own-session"])
def stores(request: pytest.FixtureRequest, azurite: Any) -> tuple[TableStateStore, TableStateStore]:
    """Two instances on one table whose transactions go through the SDK or through this transport (own-session: on
    the deadline module's sessions, as the wiring builds the store)."""
    name = f"batchstore{uuid.uuid4().hex[:10]}"
    made = deadline.session if request.param == "own-session" else None
    owned = TableStateStore.from_connection_string(azurite.connection_string, table_name=name, session=made)
    assert isinstance(owned._table, TransactionTableClient)
    if request.param.startswith("own"):
        return owned, TableStateStore.from_connection_string(azurite.connection_string, table_name=name, session=made)
    service = TableServiceClient.from_connection_string(azurite.connection_string)

    def sdk() -> TableStateStore:
        return TableStateStore(
            table=service.get_table_client(name), dead_letters=service.get_table_client(f"{name}deadletters")
        )

    return sdk(), sdk()


def test_the_store_meets_conflicts_and_oversized_entities_alike(
    stores: tuple[TableStateStore, TableStateStore],
) -> None:
    store, peer = stores
    ids = [f"EV-{n}" for n in range(40)]
    ids = [i for i in ids if event_partition(i) == event_partition(ids[0])][:3]
    etags = store.save_events([(event_record(i), None) for i in ids])
    peer.save_event(event_record(ids[2], state="Approved"), etags[2])
    with pytest.raises(ConcurrencyConflict):
        store.save_events([(event_record(i, state="Started"), e) for i, e in zip(ids, etags, strict=True)])
    assert [s.record.state for s in peer.get_events(ids).values()] == ["Scheduled", "Scheduled", "Approved"]

    # Past what entities.py checks (a property over 64 KiB): the table refuses it, in a transaction of two.
    big = [i for i in (f"EV-big-{n}" for n in range(40)) if event_partition(i) == event_partition("EV-big-0")][:2]
    writes: list[Write] = [
        ({**event_entity(event_record(i)), "Extra": "x" * 40_000}, None, event_record(i)) for i in big
    ]
    with pytest.raises(RecordTooLarge):
        store._save_many(writes)
    assert store.get_events(big) == {}
    assert store.save_events([]) == []
    assert store.claim_many([]) == {}


def test_a_store_on_the_deadline_sessions_reads_the_environment_once_per_client(
    azurite: Any, environment_lookups: list[str]
) -> None:
    store = TableStateStore.from_connection_string(
        azurite.connection_string, table_name=f"batchenv{uuid.uuid4().hex[:10]}", session=deadline.session
    )
    environment_lookups.clear()  # what making the store read
    ids = [f"EV-env-{n}" for n in range(6)]
    etags = [store.save_events([(event_record(i), None)])[0] for i in ids]
    store.save_events([(event_record(i, state="Approved"), e) for i, e in zip(ids[:1], etags, strict=False)])
    assert len(store.get_events(ids)) == 6
    assert len(environment_lookups) == 1  # every request went to the one table service: read by the first alone
