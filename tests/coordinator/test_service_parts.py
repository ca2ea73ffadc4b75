"""The coordinator's constructor (coordinator/service.py): ``Coordinator(parts, options, policy)``, built once;
contradictory settings refused when it is built and when a part or option is replaced; each run takes the parts,
options and policy as they are when it starts; a replaced store gets a fresh fleet cache. On the in-memory store."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import pytest

from coordinator.domain.attestation import Attestations
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy, parse_policy
from coordinator.pipeline.run import Options, Parts
from coordinator.service import Coordinator
from tests.coordinator.attested import verifier
from tests.coordinator.helpers import DOC_NOW, MemoryHistory
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingAlerts, RecordingCallback, make_coordinator

POLICY = load_policy(DEFAULT_POLICY_PATH)


def parts(**changes: object) -> Parts:
    base = Parts(
        store=MemoryStateStore(),
        history=MemoryHistory(),
        alerts=RecordingAlerts(),
        callback=RecordingCallback(),
        clock=lambda: DOC_NOW,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_required_attestation_without_a_verifier_is_refused_when_built_and_when_replaced():
    with pytest.raises(ValueError, match="require_attestation needs attestations"):
        Coordinator(parts(), Options(require_attestation=True), POLICY)
    coordinator = Coordinator(parts(attestations=Attestations(verifier())), Options(require_attestation=True), POLICY)
    with pytest.raises(ValueError, match="require_attestation needs attestations"):
        coordinator.parts = replace(coordinator.parts, attestations=None)
    plain = Coordinator(parts(), Options(), POLICY)
    with pytest.raises(ValueError, match="require_attestation needs attestations"):
        plain.options = replace(plain.options, require_attestation=True)
    assert plain.options.require_attestation is False, "a refused replacement leaves the options as they were"


def test_the_tail_after_the_batch_and_its_executor_go_together():
    with ThreadPoolExecutor(max_workers=1) as tails:
        with pytest.raises(ValueError, match="tail_after_batch goes with the after_batch executor"):
            Coordinator(parts(), Options(), POLICY, after_batch=tails)
        with pytest.raises(ValueError, match="tail_after_batch goes with the after_batch executor"):
            Coordinator(parts(), Options(tail_after_batch=True), POLICY)
        coordinator = Coordinator(parts(), Options(tail_after_batch=True), POLICY, after_batch=tails)
        with pytest.raises(ValueError, match="tail_after_batch goes with the after_batch executor"):
            coordinator.options = replace(coordinator.options, tail_after_batch=False)


def test_each_run_takes_the_parts_options_and_policy_as_they_are_when_it_starts():
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=MemoryHistory(),
        alerts=RecordingAlerts(),
        callback=RecordingCallback(),
        policy=POLICY,
        clock=lambda: DOC_NOW,
    )
    first = coordinator.start("tick")
    slower, later = RecordingCallback(), DOC_NOW + timedelta(hours=1)
    coordinator.parts = replace(coordinator.parts, callback=slower, clock=lambda: later)
    coordinator.options = replace(coordinator.options, dry_run=True)
    coordinator.policy = parse_policy("rules: [{name: people, match: {eventType: [Freeze]}, action: wait-for-person}]")
    second = coordinator.start("tick")
    assert (first.parts.callback is slower, first.now, first.options.dry_run) == (False, DOC_NOW, False)
    assert (second.parts.callback is slower, second.now, second.options.dry_run) == (True, later, True)
    assert [rule.name for rule in second.policy.rules] == ["people"]
    assert first.pool == second.pool, "the approval senders' threads are the instance's, whatever is replaced"


def test_a_replaced_store_gets_a_fresh_fleet_cache():
    coordinator = Coordinator(parts(), Options(), POLICY)
    kept = coordinator.start("tick").fleet
    assert coordinator.start("tick").fleet.cache is kept.cache
    coordinator.parts = replace(coordinator.parts, callback=RecordingCallback())
    assert coordinator.start("tick").fleet.cache is kept.cache, "another callback keeps the cache"
    other = MemoryStateStore()
    coordinator.parts = replace(coordinator.parts, store=other)
    fresh = coordinator.start("tick").fleet
    assert fresh.cache is not kept.cache
    assert fresh.cache.store is other
