"""The broker's $cbs and $management nodes: CBS tokens put on a connection, and the hub's and partitions' properties
read, each request answered on its session's reply link."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from proton import (
    UNDESCRIBED,
    Array,
    Connection,
    Data,
    Endpoint,
    Link,
    Message,
    timestamp,
)

from emulators.eventhubs import messages
from emulators.eventhubs.auth import JWT_TOKEN_TYPE, SAS_TOKEN_TYPE, AuthError, resource_path, validate_token
from emulators.eventhubs.broker_state import CBS_NODE, UNAUTHORIZED, BrokerState, Peer, Refusal
from emulators.eventhubs.partition_log import PartitionLog

_LOG = logging.getLogger("emulators.eventhubs")


class ControlNodes(BrokerState):
    """Requests to $cbs and $management, as the SDKs send them."""

    def _reply(self, link: Link, node: str, request: Message, *, status: int, description: str, body: Any) -> None:
        reply_link = next(
            (
                candidate
                for candidate in _links(link.session.connection)
                if candidate.is_sender
                and candidate.session == link.session
                and candidate.remote_source.address == node
                and candidate.state & Endpoint.LOCAL_ACTIVE
            ),
            None,
        )
        if reply_link is None:
            _LOG.warning("no reply link for a %s request on this session; the client will time out", node)
            return
        reply = Message(
            correlation_id=request.id,
            # $cbs replies are read as status-description, $management ones (by pyamqp) as statusDescription.
            properties={"status-code": status, "status-description": description, "statusDescription": description},
            body=body,
        )
        reply_link.send(reply).settle()

    def _on_request(self, peer: Peer, link: Link, node: str, payload: bytes) -> None:
        try:
            request = messages.decode(payload)
        except messages.MessageError as error:
            _LOG.warning("undecodable %s request: %s", node, error)
            return
        properties: dict[str, Any] = dict(request.properties or {})
        if node == CBS_NODE:
            status, description = self._put_token(peer, properties, request.body)
            self._reply(link, node, request, status=status, description=description, body=None)
        else:
            status, description, body = self._management(peer, properties)
            self._reply(link, node, request, status=status, description=description, body=body)

    def _put_token(self, peer: Peer, properties: dict[str, Any], token: Any) -> tuple[int, str]:
        operation = properties.get("operation")
        if operation != "put-token":
            return 400, f"unsupported $cbs operation {operation!r}; only 'put-token'"
        token_type = str(properties.get("type", ""))
        audience = str(properties.get("name", ""))
        try:
            grant = validate_token(str(token), token_type, key_name=self._sas_key_name, key=self._sas_key)
        except AuthError as error:
            self._stats.tokens_refused += 1
            _LOG.info("refused CBS token for %s: %s", audience, error)
            return 401, f"Unauthorized: {error}"
        if grant.path and resource_path(audience) and not grant.covers(resource_path(audience)):
            self._stats.tokens_refused += 1
            return 401, f"Unauthorized: token for {grant.path!r} does not cover {audience!r}"
        # Clients renew tokens on a long-lived connection; forget the expired ones so the list stays short.
        now = time.time()
        peer.grants = [kept for kept in peer.grants if kept.expires_at > now]
        peer.grants.append(grant)
        return 202, "Accepted"

    def _management(self, peer: Peer, properties: dict[str, Any]) -> tuple[int, str, Any]:
        operation, kind = properties.get("operation"), properties.get("type")
        if operation != "READ":
            return 400, f"unsupported $management operation {operation!r}; only 'READ'", None
        try:
            hub = self._hub(str(properties.get("name", "")))
            self._management_grant(peer, hub, properties.get("security_token"))
            if kind == "com.microsoft:eventhub":
                return 200, "OK", self._hub_properties(hub)
            if kind == "com.microsoft:partition":
                return 200, "OK", _partition_properties(self._partition(hub, str(properties.get("partition", ""))))
        except Refusal as refusal:
            status = 401 if refusal.condition == UNAUTHORIZED else 404
            return status, refusal.description, None
        return 400, f"unsupported $management type {kind!r}", None

    def _management_grant(self, peer: Peer, hub: str, token: Any) -> None:
        """A management request carries its own token; a CBS grant on the connection also suffices."""
        if peer.authorized(hub):
            return
        if token is None:
            raise Refusal(UNAUTHORIZED, "Unauthorized: no security_token and no CBS token on this connection")
        token_type = SAS_TOKEN_TYPE if str(token).startswith("SharedAccessSignature ") else JWT_TOKEN_TYPE
        try:
            grant = validate_token(str(token), token_type, key_name=self._sas_key_name, key=self._sas_key)
        except AuthError as error:
            self._stats.tokens_refused += 1
            raise Refusal(UNAUTHORIZED, f"Unauthorized: {error}") from None
        if not grant.covers(hub):
            raise Refusal(UNAUTHORIZED, f"Unauthorized: token does not cover {hub!r}")

    def _hub_properties(self, hub: str) -> dict[str, Any]:
        partitions = self._store.partitions(hub)
        return {
            "name": hub,
            "type": "com.microsoft:eventhub",
            "created_at": timestamp(self._store.created_at_ms),
            "partition_count": len(partitions),
            "partition_ids": Array(
                UNDESCRIBED,  # type: ignore[arg-type]  # proton's annotation omits its own constant
                Data.STRING,
                *[log.partition_id for log in partitions],
            ),
        }


def _partition_properties(log: PartitionLog) -> dict[str, Any]:
    props = log.properties()
    return {
        "name": log.hub,
        "type": "com.microsoft:partition",
        "partition": log.partition_id,
        "begin_sequence_number": props.beginning_sequence_number,
        "last_enqueued_sequence_number": props.last_enqueued_sequence_number,
        "last_enqueued_offset": str(props.last_enqueued_offset),
        "last_enqueued_time_utc": timestamp(props.last_enqueued_time_ms),
        "is_partition_empty": props.is_empty,
    }


def _links(connection: Connection) -> Iterator[Link]:
    link = connection.link_head(0)
    while link is not None:
        yield link
        link = link.next(0)
