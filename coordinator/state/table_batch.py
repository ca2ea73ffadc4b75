"""Entity group transactions (the Table service's ``$batch``) without azure-core's multipart machinery.

Why: ``TableClient.submit_transaction`` builds its multipart/mixed body with Python's ``email`` generator (each
operation an ``HttpRequest`` run through its own policies, then flattened) and parses the answer with the ``email``
parser, which dominates the coordinator's CPU. Measured on Azurite (cProfile): the cold 2,000-VM wave
(``benchmarks.wave --vms 2000 --bindings cold --mode serial``) spent 30.1 s of its 41.5 s batches in 188
``submit_transaction`` calls, 12.3 s building bodies and 8.6 s parsing answers, against 3.5 s waiting on the socket;
``benchmarks.bare_hop``, whose deciding write is a transaction with its outbox entry, spent 19 s of 23 s of batches
there. This module writes the same body with string formatting and reads the answer with a parser that knows its one
shape (a changeset of HTTP responses): the same wave's 188 transactions then took 5.4 s (1.1 s building and reading,
2.5 s on the socket) and its batches 12.7 s; the wave, unprofiled, 8.5 s instead of 27-29 s (docs/limits.md).

What stays the SDK's, so nothing else changes: the request goes through the client's own pipeline (authentication,
shared key for Azurite or the managed identity's bearer token in Azure, retries, user agent, logging, tracing); the
entities are serialized by the SDK's ``_add_entity_properties`` (the same EDM types); the operations are the SDK's
(``create``, ``update``, ``upsert``, ``delete`` with ``mode``, ``etag`` and ``match_condition``) and their HTTP
requests the ones its request builders make; errors are decoded by the SDK's ``_decode_error``, so a refused
operation raises ``TableTransactionError`` with its index and error code, a refused request what the SDK raises
(``ResourceNotFoundError``, ``ClientAuthenticationError``, ``RequestTooLargeError``, ``HttpResponseError``).
``tests/coordinator/test_table_batch.py`` holds the two to the same table state and the same exceptions on Azurite.
A Cosmos DB endpoint (which wants MERGE as a POST) is left to the SDK.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from email.utils import formatdate
from typing import Any
from urllib.parse import quote

import requests
from azure.core import MatchConditions
from azure.core.exceptions import DecodeError, HttpResponseError
from azure.core.pipeline.transport import RequestsTransport
from azure.core.rest import HttpRequest
from azure.core.serialization import AzureJSONEncoder
from azure.core.tracing.decorator import distributed_trace
from azure.core.utils import case_insensitive_dict
from azure.data.tables import RequestTooLargeError, TableClient, TableEntity, TableTransactionError, UpdateMode
from azure.data.tables._error import _decode_error, _validate_tablename_error
from azure.data.tables._serialize import _add_entity_properties, _prepare_key

CRLF = "\r\n"

# Makes a table client's requests session (the wiring's: coordinator/adapters/deadline.py, the environment read once).
Sessions = Callable[[], requests.Session]


def transport_of(session: Sessions | None) -> dict[str, Any]:
    """A client's keyword options for a transport over ``session()`` (none: the SDK makes its own)."""
    return {} if session is None else {"transport": RequestsTransport(session=session())}


class TransactionTableClient(TableClient):
    """A ``TableClient`` whose ``submit_transaction`` is this module's; everything else is the SDK's."""

    @distributed_trace(name_of_span="TableClient.submit_transaction")
    def submit_transaction(self, operations: Iterable[Any], **kwargs: Any) -> list[Mapping[str, Any]]:
        if self._cosmos_endpoint:
            return super().submit_transaction(operations, **kwargs)
        base = f"{self.scheme}://{self._primary_hostname}"
        parts = requests_of(operations, base=base, table=self.table_name, version=self._client._config.version)
        if not parts:
            return []  # what the SDK answers, after the service refused an empty changeset
        batch, changeset = f"batch_{uuid.uuid4()}", f"changeset_{uuid.uuid4()}"
        request = HttpRequest(
            "POST",
            f"{base}/$batch",
            headers={
                "x-ms-version": self.api_version,
                "DataServiceVersion": "3.0",
                "MaxDataServiceVersion": "3.0;NetFx",
                "Content-Type": f"multipart/mixed; boundary={batch}",
                "Accept": "application/json",
            },
            content=batch_body(parts, batch=batch, changeset=changeset),
        )
        # Streamed, as the SDK sends it: the pipeline's ContentDecodePolicy cannot read a multipart answer.
        response = self._client.send_request(request, stream=True, **kwargs)
        if response.status_code == 413:
            raise _too_large(response)
        if response.status_code != 202:
            error = _decode_error(response)  # type: ignore[no-untyped-call]
            _validate_tablename_error(error, self.table_name)  # type: ignore[no-untyped-call]
            raise error
        answers = answer_parts(response.headers.get("content-type", ""), response.read())
        failed = [part for part in answers if not 200 <= part.status_code < 300]
        if failed:
            if failed[0].status_code == 413:
                raise _too_large(response)
            error = _decode_error(failed[0], error_type=TableTransactionError)  # type: ignore[no-untyped-call]
            _validate_tablename_error(error, self.table_name)  # type: ignore[no-untyped-call]
            raise error
        return [{"etag": part.headers["etag"]} if "etag" in part.headers else {} for part in answers]


def _too_large(response: Any) -> HttpResponseError:
    error: HttpResponseError = _decode_error(  # type: ignore[no-untyped-call]
        response, error_message="The transaction request was too large", error_type=RequestTooLargeError
    )
    return error


# requests -----------------------------------------------------------------------------------------------------------
def requests_of(operations: Iterable[Any], *, base: str, table: str, version: str) -> list[str]:
    """Each operation as the HTTP request the SDK's builders make of it (request line, headers, body), in order.
    Raises as ``TableBatchOperations`` does: ``ValueError`` for an unknown operation, a missing key or two
    partitions, ``TypeError`` for what is not an operation or a value the SDK cannot serialize."""
    partition: str | None = None
    out: list[str] = []
    table_url = f"{base}/{quote(table, safe='')}"
    try:
        for operation in operations:
            kind, entity, options = (*operation, {}) if len(operation) == 2 else operation
            if "PartitionKey" not in entity or "RowKey" not in entity:
                raise ValueError("PartitionKey and/or RowKey were not provided in entity")
            if partition is None:
                partition = entity["PartitionKey"]
            elif entity["PartitionKey"] != partition:
                raise ValueError("Partition Keys in the batch must all be the same.")
            out.append(_request(str(kind).lower(), entity, dict(options), table_url, version))
    except TypeError as error:
        raise TypeError(
            "The value of 'operations' must be an iterator of Tuples. Please check documentation for correct Tuple "
            "format."
        ) from error
    return out


def _request(kind: str, entity: Any, options: dict[str, Any], table_url: str, version: str) -> str:
    common = f"x-ms-version: {version}{CRLF}DataServiceVersion: 3.0{CRLF}"
    if kind == "create":
        _no_options(kind, options)
        body = _json(entity)
        head = f"POST {table_url} HTTP/1.1{CRLF}"
        return head + _with_body(body, common + f"Accept: application/json;odata=minimalmetadata{CRLF}")
    url = (
        f"{table_url}(PartitionKey='{quote(_prepare_key(entity['PartitionKey']), safe='')}',"
        f"RowKey='{quote(_prepare_key(entity['RowKey']), safe='')}')"
    )
    if kind == "delete":
        if_match = _if_match(entity, options.pop("etag", None), options.pop("match_condition", None))
        _no_options(kind, options)
        head = f"DELETE {url} HTTP/1.1{CRLF}{common}Accept: application/json;odata=minimalmetadata{CRLF}"
        return head + f"If-Match: {if_match}{CRLF}{CRLF}"
    if kind not in ("update", "upsert"):
        raise ValueError(f"Unrecognized operation: {kind}")
    mode = options.pop("mode", UpdateMode.MERGE)
    # An upsert sends no If-Match: it inserts or replaces (merges) whatever is there.
    condition = ""
    if kind == "update":
        etag = _if_match(entity, options.pop("etag", None), options.pop("match_condition", None))
        condition = f"If-Match: {etag}{CRLF}"
    _no_options(kind, options)
    if mode == UpdateMode.REPLACE:
        method = "PUT"
    elif mode == UpdateMode.MERGE:
        method = "PATCH"
    else:
        raise ValueError(f"Mode type '{mode}' is not supported.")
    headers = f"{common}Accept: application/json{CRLF}{condition}"
    return f"{method} {url} HTTP/1.1{CRLF}" + _with_body(_json(entity), headers)


def _no_options(kind: str, options: Mapping[str, Any]) -> None:
    # The SDK would pass any other option on to its request builder; none is used here, so one is a mistake.
    if options:
        raise ValueError(f"options not supported for {kind} in a transaction: {sorted(options)}")


def _if_match(entity: Any, etag: str | None, condition: MatchConditions | None) -> str:
    if condition and not etag and isinstance(entity, TableEntity):
        etag = entity.metadata.get("etag")
    condition = condition or MatchConditions.Unconditionally
    if condition == MatchConditions.IfNotModified:
        if not etag:
            raise ValueError("IfNotModified must be specified with etag.")
        return etag
    if condition == MatchConditions.Unconditionally:
        if etag:
            raise ValueError("Etag is not supported for an Unconditional operation.")
        return "*"
    raise ValueError(f"Unsupported match condition: {condition}")


def _json(entity: Any) -> str:
    # ASCII (non-ASCII characters escaped, as the SDK sends them): the part's length in characters is its length in
    # bytes.
    return json.dumps(_add_entity_properties(entity), cls=AzureJSONEncoder)


def _with_body(body: str, headers: str) -> str:
    return f"Content-Type: application/json{CRLF}Content-Length: {len(body)}{CRLF}{headers}{CRLF}{body}"


def batch_body(parts: list[str], *, batch: str, changeset: str) -> bytes:
    """The ``$batch`` body: one changeset holding every request, each with its Content-ID (its index), and the
    date headers the SDK's policies give each part."""
    date = formatdate(usegmt=True)
    dated = f"x-ms-date: {date}{CRLF}Date: {date}{CRLF}"
    out = [f"--{batch}{CRLF}Content-Type: multipart/mixed; boundary={changeset}{CRLF}{CRLF}"]
    for index, part in enumerate(parts):
        head, _, body = part.partition(CRLF + CRLF)
        out.append(
            f"--{changeset}{CRLF}Content-Type: application/http{CRLF}Content-Transfer-Encoding: binary{CRLF}"
            f"Content-ID: {index}{CRLF}{CRLF}{head}{CRLF}{dated}{CRLF}{body}{CRLF}"
        )
    out.append(f"--{changeset}--{CRLF}{CRLF}--{batch}--{CRLF}")
    return "".join(out).encode("utf-8")


# answers ------------------------------------------------------------------------------------------------------------
class Answer:
    """One operation's HTTP response within the batch's answer, with what the SDK's ``_decode_error`` and
    ``HttpResponseError`` read of a response."""

    def __init__(self, status_code: int, reason: str, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.reason = reason
        self.headers = case_insensitive_dict(headers)
        self.content = content

    @property
    def content_type(self) -> str | None:
        value = self.headers.get("content-type")
        return None if value is None else str(value)

    def body(self) -> bytes:
        return self.content

    def text(self, encoding: str | None = None) -> str:
        return self.content.decode(encoding or "utf-8-sig", errors="replace")


def _boundary(content_type: str) -> str:
    for parameter in content_type.split(";")[1:]:
        name, _, value = parameter.strip().partition("=")
        if name.lower() == "boundary":
            return value.strip('"')
    raise DecodeError(f"a $batch answer without a boundary: {content_type!r}")


def answer_parts(content_type: str, body: bytes) -> list[Answer]:
    """The HTTP responses of a multipart/mixed answer, in order, nested multiparts (the changeset) opened."""
    delimiter = b"--" + _boundary(content_type).encode("ascii")
    answers: list[Answer] = []
    for raw in body.split(delimiter)[1:]:
        if raw.startswith(b"--"):
            break  # the closing delimiter
        head, _, content = raw.lstrip(b"\r\n").partition(b"\r\n\r\n")
        headers = _headers(head)
        kind = headers.get("content-type", "")
        if kind.lower().startswith("multipart/mixed"):
            answers.extend(answer_parts(kind, content))
        else:
            answers.append(_http_response(content))
    return answers


def _headers(block: bytes) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in block.decode("utf-8", errors="replace").split(CRLF):
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return headers


def _http_response(message: bytes) -> Answer:
    head, _, content = message.partition(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    fields = status_line.decode("ascii", errors="replace").split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise DecodeError(f"a $batch part that is not an HTTP response: {status_line[:200]!r}")
    # The part ends with the CRLF that belongs to the next delimiter.
    if content.endswith(b"\r\n"):
        content = content[:-2]
    return Answer(int(fields[1]), fields[2] if len(fields) > 2 else "", _headers(header_block), content)
