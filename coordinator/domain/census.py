"""The census: where each VM of the fleet sits and its tags, as Azure Resource Manager lists them, and what a VM says
of itself that ARM does not.

Pure: ``CensusEntry`` is one VM as coordinator/adapters/census.py read it from ARM; ``disagreements`` compares what a
VM's envelopes say of it (its ``VmIdentity``, from its own instance metadata) with that entry. Budgets and tag rules
read only the entries (coordinator/pipeline/fleet.py): every VM of a scale set shares one Event Hubs identity, so
what an envelope says of a VM is that VM's claim, or another VM's, while ARM's lists come from the platform, read
with the coordinator's own identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from contracts.envelope import VmIdentity
from coordinator.domain.controls import VmFacts

__all__ = ["CensusEntry", "describe", "disagreements", "identity_problem"]


@dataclass(frozen=True)
class CensusEntry:
    """One VM as ARM lists it: its name (as IMDS and scheduled events' ``Resources`` spell it), its vmId and
    resource id, and its facts (scale set, zone, fault and update domain, placement group, tags)."""

    name: str
    vmId: str
    resourceId: str
    facts: VmFacts


def _tags(tags: Mapping[str, str]) -> dict[str, str]:
    # Azure's tag names are case-insensitive; their values are not.
    return {name.lower(): value for name, value in tags.items()}


def disagreements(reported: VmIdentity, listed: CensusEntry | None) -> dict[str, tuple[str, str]]:
    """What ``reported`` (a VM's identity from its envelopes) says that ARM's entry for that name does not, as
    {fact: (ARM's value, the VM's)}; ``listed`` None: ARM does not list a VM of that name at all. An update domain
    the VM did not report (forwarders before it was added) is not a disagreement."""
    if listed is None:
        return {"listed": ("no", "yes")}
    arm = listed.facts
    found: dict[str, tuple[str, str]] = {}
    pairs = {
        "vmId": (listed.vmId.lower(), reported.vmId.lower()),
        "scaleSet": (arm.scaleSet.lower(), reported.vmScaleSetName.lower()),
        "location": (arm.location.lower(), reported.location.lower()),
        "zone": (arm.zone, reported.zone),
        "faultDomain": (arm.faultDomain, reported.platformFaultDomain),
        "placementGroup": (arm.placementGroup.lower(), reported.placementGroupId.lower()),
    }
    if reported.platformUpdateDomain:
        pairs["updateDomain"] = (arm.updateDomain, reported.platformUpdateDomain)
    for fact, (theirs, its) in pairs.items():
        if theirs != its:
            found[fact] = (theirs, its)
    if _tags(arm.tags) != _tags(reported.tags):
        found["tags"] = (_text(arm.tags), _text(reported.tags))
    return found


def identity_problem(reported: VmIdentity, by_name: CensusEntry | None, by_resource: CensusEntry | None) -> str | None:
    """Whether the name, resource id and vmId an envelope claims together are one VM as ARM lists it: "" when they
    are, the reason when they are not, None when ARM lists neither the name nor the resource id (a VM that joined
    since the last read, or one outside the census' scopes: the bindings decide, pipeline/attest.py).

    Every VM shares one sender identity and attests only its own vmId, so the name in its envelope is its claim:
    taken as written, a VM with root on itself could speak as another with its own identity (take the approvals of
    the other's events, silence it, report its hooks).
    ``by_name``: ARM's VM of the reported name; ``by_resource``: ARM's VM of the reported resource id."""
    if by_name is None and by_resource is None:
        return None
    resource = reported.resourceId.lower()[:300]
    if by_resource is None:
        assert by_name is not None
        return (
            f"vm.name {reported.name[:64]!r} is not its resource id's name: ARM lists {by_name.name[:64]!r} as "
            f"{by_name.resourceId[:300]}, and no VM as {resource}; refused"
        )
    if by_resource.name.lower() != reported.name.lower():
        return (
            f"vm.name {reported.name[:64]!r} is not its resource id's name: ARM names {resource} "
            f"{by_resource.name[:64]!r}: a VM speaks under another VM's name; refused"
        )
    if by_resource.vmId and by_resource.vmId.lower() != reported.vmId.lower():
        return (
            f"vmId {reported.vmId[:64]} is not its resource id's: ARM lists {resource} as VM {by_resource.vmId[:64]}: "
            "another VM speaks under its name; refused"
        )
    return ""


def _text(tags: Mapping[str, str]) -> str:
    return ";".join(f"{name}:{value}" for name, value in sorted(tags.items()))


def describe(found: dict[str, tuple[str, str]]) -> str:
    """The disagreements in one line, the same for the same differences (a VM is flagged again only when what it
    says, or what ARM says, changes)."""
    if "listed" in found:
        return "ARM lists no VM of this name"
    return "; ".join(f"{fact} {its!r} (ARM: {theirs!r})" for fact, (theirs, its) in sorted(found.items()))
