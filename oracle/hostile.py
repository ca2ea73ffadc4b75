"""The generator's hostile input (oracle/generate.py): lies a VM sends within the fleet's shared identity, messages
no schema allows, and attacks by a process with root on one fleet VM (issue 34), as ``forge`` steps the local platform
plays (local/forgeries.py)."""

from __future__ import annotations

import random
from typing import Any, Protocol

__all__ = ["ROOTED_ATTACKS", "attackers", "forgeries"]

ROOTED_ATTACKS = ("name", "silence", "name-hook", "name-impact", "squat", "malformed", "liar")


class Draw(Protocol):
    """generate._Draw: a seeded stream of choices and the notes of what was drawn."""

    rng: random.Random

    def chance(self, p: float) -> bool: ...

    def pick(self, options: list[Any]) -> Any: ...

    def note(self, text: str) -> None: ...


def forgeries(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Lies about a peer's events (within the placement group, whose events the forger's IMDS shows), and messages
    under the forger's own identity that no schema allows (too deep) or that are as large as the door lets in."""
    steps = []
    if draw.chance(0.3):
        steps.extend(_lies(draw, vms, events))
    if draw.chance(0.2):
        by = draw.pick(vms)["name"]
        kind = draw.pick(["deep", "oversized"])
        at = draw.rng.randrange(0, 481, 30)
        steps.append({"at": at, "forge": {"by": by, "about": by, "kind": kind}})
        draw.note(f"at {at}: {by} sends {kind}")
    return steps


def _lies(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, list[str]] = {}
    for vm in vms:
        if vm.get("placementGroupId") and not vm.get("isolated"):
            groups.setdefault(vm["placementGroupId"], []).append(vm["name"])
    pairs = [(a, b) for members in groups.values() for a in members for b in members if a != b]
    targets = [e for e in events if "create" in e and e["create"].get("EventStatus") != "Started"]
    if not pairs or not targets:
        return []
    steps = []
    for _ in range(draw.rng.randint(1, 2)):
        target = draw.pick(targets)
        victims = target["create"]["Resources"]
        candidates = [(by, about) for by, about in pairs if about in victims]
        if not candidates:
            continue
        by, about = draw.pick(candidates)
        kind = draw.pick(["relabel", "user", "hook", "gone", "sequence"])
        at = target["at"] + 60
        steps.append({"at": at, "forge": {"by": by, "about": about, "kind": kind}})
        draw.note(f"at {at}: {by} forges {kind} about {about}")
    return steps


def attackers(draw: Draw, vms: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attacks by a process with root on one fleet VM (issue 34; local/forgeries.py): another VM's name with its own
    identity (an approval to steal, a VM to silence, hooks and impact to report), a squatter on another VM's
    resource id, a damaged document, a lying listener on another VM's hybrid connection. Drawn from a stream of
    their own (``draw``), so that a seed's plan is the same with or without them."""
    if not draw.chance(0.6):
        return []
    groups: dict[str, list[str]] = {}
    for vm in vms:
        if vm.get("placementGroupId") and not vm.get("isolated"):
            groups.setdefault(vm["placementGroupId"], []).append(vm["name"])
    peers = {name: [n for n in members if n != name] for members in groups.values() for name in members}
    targets = [e for e in events if "create" in e and e["create"].get("EventStatus") != "Started"]
    steps: list[dict[str, Any]] = []
    for _ in range(draw.rng.randint(1, 2)):
        kind = draw.pick(list(ROOTED_ATTACKS))
        if kind == "malformed" or not targets:
            by = draw.pick(vms)["name"]
            at = draw.rng.randrange(0, 481, 30)
            steps.append({"at": at, "forge": {"by": by, "about": by, "kind": "malformed"}})
            draw.note(f"at {at}: {by} sends a damaged document")
            continue
        target = draw.pick(targets)
        named = target["create"]["Resources"]
        # A liar sits where the approval may go: a VM the event names, or a peer that sees it (any that reports it
        # first may execute it).
        about = draw.pick(sorted({*named, *peers.get(named[0], [])}) if kind == "liar" else named)
        # Its own IMDS shows the victim's events only within their placement group; the squatter (a name and a
        # resource id) and the liar (a hybrid connection) need none of them.
        others = [vm["name"] for vm in vms if vm["name"] != about]
        candidates = others if kind in ("squat", "liar") else peers.get(about, [])
        if not candidates:
            continue
        by = draw.pick(candidates)
        # With the event (heard before the truth, before it is decided); the liar listens before the approval goes.
        at = max(0, target["at"] - 30) if kind == "liar" else target["at"]
        steps.append({"at": at, "forge": {"by": by, "about": about, "kind": kind}})
        draw.note(f"at {at}: {by} with root attacks {about}: {kind}")
    return steps
