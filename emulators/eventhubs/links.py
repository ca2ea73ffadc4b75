"""The broker's links and transfers: publisher and consumer links attached (or refused) as the service would, owner
levels, events stored in their partition (by key, by partition, or round robin) and pumped to the receivers."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from azure.eventhub._buffered_producer._partition_resolver import generate_hash_code
from proton import (
    Condition,
    Delivery,
    Link,
    Terminus,
    symbol,
    timestamp,
)

from emulators.eventhubs import messages
from emulators.eventhubs.addresses import (
    SELECTOR_FILTER,
    AddressError,
    ConsumeSource,
    PublishTarget,
    parse_consume_source,
    parse_publish_target,
    parse_selector,
)
from emulators.eventhubs.broker_state import (
    CBS_NODE,
    DECODE_ERROR,
    INVALID_FIELD,
    LINK_STOLEN,
    MANAGEMENT_NODE,
    MAX_MESSAGE_SIZE,
    NOT_FOUND,
    UNAUTHORIZED,
    Peer,
    Refusal,
    Subscription,
)
from emulators.eventhubs.control_nodes import ControlNodes
from emulators.eventhubs.partition_log import PartitionLog, RejectedTransfer

_LOG = logging.getLogger("emulators.eventhubs")

_LINK_CREDIT = 100
_SEQUENCE_NUMBER = symbol("x-opt-sequence-number")
_OFFSET = symbol("x-opt-offset")
_ENQUEUED_TIME = symbol("x-opt-enqueued-time")
_EPOCH = symbol("com.microsoft:epoch")


def partition_for_key(partition_key: str, partition_count: int) -> int:
    """Partition key → partition with the Jenkins lookup3 hash the SDK's buffered producer uses to mirror the
    service, so keyed sends land where a buffered producer would put them."""
    hash_code: int = generate_hash_code(partition_key)  # type: ignore[no-untyped-call]  # untyped SDK helper
    return abs(hash_code % partition_count)


class Links(ControlNodes):
    """Links attached on the broker's connections and the transfers on them."""

    def _on_link_open(self, peer: Peer, link: Link) -> None:
        source, target = link.remote_source.address, link.remote_target.address
        if source is not None:
            link.source.address = source
        if target is not None:
            link.target.address = target
        try:
            if link.is_receiver:
                self._on_publisher_link(peer, link, target or "")
            else:
                self._on_consumer_link(peer, link, source or "")
        except Refusal as refusal:
            # A refusal per AMQP 1.0 §2.6.3: attach with a null terminus on our side, then detach with the error.
            # pyamqp needs that null terminus to notice; with both present it would wait for the link forever.
            self._stats.links_refused += 1
            _LOG.info("refused link %r: %s (%s)", link.name, refusal.description, refusal.condition)
            (link.target if link.is_receiver else link.source).type = Terminus.UNSPECIFIED
            link.condition = Condition(refusal.condition, refusal.description)
            link.open()
            link.close()

    def _on_publisher_link(self, peer: Peer, link: Link, address: str) -> None:
        if address not in (CBS_NODE, MANAGEMENT_NODE):
            try:
                target = parse_publish_target(address)
            except AddressError as error:
                raise Refusal(NOT_FOUND, str(error)) from None
            hub = self._hub(target.hub)
            if target.partition is not None:
                self._partition(hub, target.partition)
            self._require_grant(peer, hub if target.partition is None else f"{hub}/Partitions/{target.partition}")
            peer.publishers[link] = PublishTarget(hub=hub, partition=target.partition)
            link.max_message_size = MAX_MESSAGE_SIZE
        link.open()
        link.flow(_LINK_CREDIT)

    def _on_consumer_link(self, peer: Peer, link: Link, address: str) -> None:
        if address in (CBS_NODE, MANAGEMENT_NODE):
            link.open()
            return
        try:
            source = parse_consume_source(address)
            position = parse_selector(_selector_of(link))
        except AddressError as error:
            raise Refusal(INVALID_FIELD if "selector" in str(error) else NOT_FOUND, str(error)) from None
        hub = self._hub(source.hub)
        if source.consumer_group.lower() not in self._consumer_groups:
            raise Refusal(NOT_FOUND, f"event hub {hub!r} has no consumer group {source.consumer_group!r}")
        log = self._partition(hub, source.partition)
        self._require_grant(peer, f"{hub}/ConsumerGroups/{source.consumer_group}/Partitions/{source.partition}")
        epoch = _epoch_of(link)
        if not self._claim_epoch(source, log, epoch):
            raise Refusal(
                LINK_STOLEN,
                f"a receiver with a higher owner level holds {hub}/{source.consumer_group}/{source.partition}",
            )
        subscription = Subscription(link, source, log, position, log.start_index(position), epoch)
        peer.subscriptions[link] = subscription
        link.max_message_size = MAX_MESSAGE_SIZE
        link.open()
        self._stats.receivers_attached += 1
        self._pump(subscription)

    def _subscriptions(self) -> Iterator[tuple[Peer, Subscription]]:
        for peer in self._peers:
            for subscription in list(peer.subscriptions.values()):
                yield peer, subscription

    def _claim_epoch(self, source: ConsumeSource, log: PartitionLog, epoch: int | None) -> bool:
        """Owner level (epoch), as the service applies it per consumer group and partition: a receiver with an
        owner level disconnects those with a lower one and those without; one with a lower level, or one without
        while an owner holds the partition, is refused."""
        rivals = [
            (peer, sub)
            for peer, sub in self._subscriptions()
            if sub.log is log and sub.source.consumer_group.lower() == source.consumer_group.lower()
        ]
        owners = [sub.epoch for _, sub in rivals if sub.epoch is not None]
        if epoch is None:
            return not owners
        if any(owner > epoch for owner in owners):
            return False
        for peer, sub in rivals:
            peer.subscriptions.pop(sub.link, None)
            sub.link.condition = Condition(LINK_STOLEN, f"a receiver with owner level {epoch} took over")
            sub.link.close()
        return True

    def _on_transfer(self, peer: Peer, delivery: Delivery) -> None:
        link = delivery.link
        payload = link.recv(delivery.pending) or b""
        link.advance()
        address = link.remote_target.address
        if address in (CBS_NODE, MANAGEMENT_NODE):
            self._on_request(peer, link, address, payload)
            delivery.update(Delivery.ACCEPTED)
        else:
            target = peer.publishers.get(link)
            outcome = self._on_publish(peer, target, payload) if target else (NOT_FOUND, "link is not attached")
            if outcome is None:
                delivery.update(Delivery.ACCEPTED)
            else:
                self._stats.deliveries_rejected += 1
                delivery.local.condition = Condition(*outcome)
                delivery.update(Delivery.REJECTED)
        delivery.settle()
        if link.credit < _LINK_CREDIT // 2:
            link.flow(_LINK_CREDIT - link.credit)

    def _on_publish(self, peer: Peer, target: PublishTarget, payload: bytes) -> tuple[str, str] | None:
        """Stores the event(s); returns None, or (condition, description) for a rejection."""
        entity = target.hub if target.partition is None else f"{target.hub}/Partitions/{target.partition}"
        if not peer.authorized(entity):
            return UNAUTHORIZED, f"the CBS token for {entity!r} expired; put a new one on $cbs"
        try:
            events = messages.unpack(payload)
        except messages.MessageError as error:
            _LOG.warning("rejected a %d-byte transfer to %s: %s", len(payload), target.hub, error)
            self._rejected.append(RejectedTransfer(hub=target.hub, reason=str(error), payload=payload))
            return DECODE_ERROR, str(error)
        self.store_events(target.hub, events, partition=target.partition)
        return None

    def store_events(self, hub: str, events: list[tuple[bytes, str | None]], *, partition: str | None = None) -> None:
        """Appends a batch (encoded messages with their partition key) to its partition and feeds the receivers."""
        partitions = self._store.partitions(hub)
        if partition is not None:
            log = partitions[int(partition)]
        elif events[0][1] is not None:
            log = partitions[partition_for_key(events[0][1], len(partitions))]
        else:
            # Without a key the service spreads whole batches over partitions; a batch stays together, in order.
            turn = self._round_robin.get(hub, 0)
            self._round_robin[hub] = turn + 1
            log = partitions[turn % len(partitions)]
        stored = log.append(events, now_ms=int(time.time() * 1000))
        self._stats.events_stored += len(stored)
        for _, subscription in self._subscriptions():
            if subscription.log is log:
                self._pump(subscription)

    def _pump(self, subscription: Subscription) -> None:
        link, log = subscription.link, subscription.log
        while link.credit > 0 and subscription.next_index < len(log):
            event = log.get(subscription.next_index)
            if not subscription.reached:
                subscription.reached = subscription.position.admits(
                    offset=event.offset, sequence_number=event.sequence_number, enqueued_time_ms=event.enqueued_time_ms
                )
                if not subscription.reached:
                    subscription.next_index += 1
                    continue
            message = event.decoded()
            annotations = dict(message.annotations or {})
            annotations[_SEQUENCE_NUMBER] = event.sequence_number
            annotations[_OFFSET] = str(event.offset)
            annotations[_ENQUEUED_TIME] = timestamp(event.enqueued_time_ms)
            if event.partition_key is not None:
                annotations[messages.PARTITION_KEY] = event.partition_key
            message.annotations = annotations
            message.instructions = _runtime_metrics(log)
            # Pre-settled: Event Hubs receivers are at-most-once on the wire; checkpoints give the guarantees.
            link.send(message).settle()
            subscription.next_index += 1


def _runtime_metrics(log: PartitionLog) -> dict[str | int, Any]:
    """Delivery annotations for ``track_last_enqueued_event_properties``. The service sends them only to receivers
    that desire com.microsoft:enable-receiver-runtime-metric; proton's binding does not expose a link's desired
    capabilities, so every receiver gets them (the SDK reads them only when asked to)."""
    props = log.properties()
    return {
        symbol("last_enqueued_sequence_number"): props.last_enqueued_sequence_number,
        symbol("last_enqueued_offset"): str(props.last_enqueued_offset),
        symbol("last_enqueued_time_utc"): timestamp(props.last_enqueued_time_ms),
        symbol("runtime_info_retrieval_time_utc"): timestamp(int(time.time() * 1000)),
    }


def _selector_of(link: Link) -> str | None:
    """The selector filter's expression from the source's filter map, if any."""
    data = link.remote_source.filter
    if data is None:
        return None
    data.rewind()
    if data.next() is None:
        return None
    filters = data.get_object()
    if not isinstance(filters, dict):
        return None
    for key, value in filters.items():
        if str(key) == SELECTOR_FILTER or str(getattr(value, "descriptor", "")) == SELECTOR_FILTER:
            return str(getattr(value, "value", value))
    return None


def _epoch_of(link: Link) -> int | None:
    properties = link.remote_properties or {}
    epoch = properties.get(_EPOCH)
    return None if epoch is None else int(epoch)
