"""The census adapter (coordinator/adapters/census.py) against the IMDS emulator's ARM face over HTTP, as it reads
Azure: a Uniform scale set's instances, a Flexible scale set's members and standalone VMs, each with the facts the
same VM's instance metadata shows; every page; a VM a delete removed gone from the lists; ARM's refusals named;
throttling retried. Then the cache (``Census``): read once for the runs, again by the timer, for a VM it does not
list (rate-limited), after a membership change; the last good read kept while ARM fails, and not usable once too
old."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.census import ArmCensusReader, Census, CensusError, resource_group_id
from coordinator.domain.census import CensusEntry, describe, disagreements
from coordinator.domain.controls import VmFacts
from emulators.imds import ImdsEmulator
from emulators.tokens import mint_token
from forwarder.imds import identity_of
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.runs import imds_serving

SUBSCRIPTION = "00000000-0000-0000-0000-0000000c0501"
GROUP = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-fleet"
OTHER_GROUP = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-other"
VMS: list[dict[str, Any]] = [
    # Uniform: instances of "web" (resource ids .../virtualMachineScaleSets/web/virtualMachines/N).
    {"name": "web_0", "vmScaleSetName": "web", "zone": "1", "platformFaultDomain": 0, "platformUpdateDomain": 0,
     "placementGroupId": "pg-web", "tags": {"tier": "front", "scheduled-events": "auto"}},
    {"name": "web_1", "vmScaleSetName": "web", "zone": "2", "platformFaultDomain": 1, "platformUpdateDomain": 1,
     "placementGroupId": "pg-web"},
    {"name": "web_2", "vmScaleSetName": "web", "zone": "3", "platformFaultDomain": 2, "placementGroupId": "pg-web"},
    # Flexible: members are VMs of their own, naming their scale set.
    {"name": "api-a1b2", "vmScaleSetName": "api", "zone": "1", "platformFaultDomain": 1, "tags": {"tier": "api"}},
    # Standalone, in an availability set.
    {"name": "db-0", "placementGroupId": "avset-db", "platformFaultDomain": 1, "platformUpdateDomain": 3},
    # Another resource group: in the census only when that group is one of its scopes.
    {"name": "ops-0", "resourceGroupName": "rg-other", "tags": {"team": "ops"}},
]  # fmt: skip


class MintedCredential:
    """FAKE Entra: the coordinator's token minted with the emulators' development key (no local Entra ID exists)."""

    def __init__(self, audience: str = "https://management.azure.com") -> None:
        self.audience = audience

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        token, expires_on = mint_token(audience=self.audience, identity_resource_id=f"{GROUP}/coordinator")
        return AccessToken(token, expires_on)


@pytest.fixture
def arm() -> Iterator[ImdsEmulator]:
    vms = [{"subscriptionId": SUBSCRIPTION, "resourceGroupName": "rg-fleet", **vm} for vm in VMS]
    scale_sets = {"web": {"terminateNotification": True}}
    # Two VMs a page: every list the census reads takes more than one.
    with imds_serving("census", vms, scale_sets=scale_sets, arm_page_size=2) as emulator:
        yield emulator


def reader(imds: ImdsEmulator, *groups: str, credential: Any = None) -> ArmCensusReader:
    return ArmCensusReader(
        credential=credential or MintedCredential(),
        resource_groups=list(groups) or [GROUP],
        arm=ArmOptions(endpoint=imds.arm_url, retry_backoff_factor=0.01),
    )


def index_built(census: Census) -> bool:
    return census._snapshot.indexed is not None


def by_name(entries: list[CensusEntry]) -> dict[str, CensusEntry]:
    return {entry.name: entry for entry in entries}


def test_every_kind_of_vm_is_read_with_the_facts_its_instance_metadata_shows(arm: ImdsEmulator) -> None:
    entries = by_name(reader(arm).read())
    assert sorted(entries) == ["api-a1b2", "db-0", "web_0", "web_1", "web_2"]
    assert entries["web_0"].facts == VmFacts(
        scaleSet="web",
        zone="1",
        location="westeurope",
        faultDomain="0",
        updateDomain="0",
        placementGroup="pg-web",
        tags={"tier": "front", "scheduled-events": "auto"},
    )
    assert entries["api-a1b2"].facts == VmFacts(
        scaleSet="api", zone="1", location="westeurope", faultDomain="1", updateDomain="0", tags={"tier": "api"}
    )
    assert entries["db-0"].facts == VmFacts(
        location="westeurope", faultDomain="1", updateDomain="3", placementGroup="avset-db"
    )
    # The same model serves IMDS and ARM: what each VM's forwarder reports of itself agrees with its entry.
    for spec in arm.vms():
        if spec.name in entries:
            assert disagreements(VmIdentity.of(identity_of(spec.compute())), entries[spec.name]) == {}, spec.name
    assert entries["web_1"].vmId == next(s.vmId for s in arm.vms() if s.name == "web_1")
    # Scale sets (one page of two), web's instances (two pages: three), the group's VMs (one page of two).
    assert arm.arm_status()["reads"] == 4


def test_the_scopes_are_the_resource_groups_given(arm: ImdsEmulator) -> None:
    assert sorted(by_name(reader(arm, OTHER_GROUP).read())) == ["ops-0"]
    assert len(reader(arm, GROUP, OTHER_GROUP).read()) == 6
    with pytest.raises(ValueError, match="not a resource group id"):
        resource_group_id("/subscriptions/x/resourceGroups/rg/providers/Microsoft.Compute")


def test_a_vm_a_delete_removed_is_no_longer_listed(arm: ImdsEmulator) -> None:
    arm.create_event(EventType="Terminate", Resources=["web_2"], StartDelaySeconds=0)
    event = arm.events()[0]
    arm.state.approve("web_2", _start_requests(event["EventId"]), arm.clock.now())
    arm.clock.advance(120)  # type: ignore[attr-defined]
    assert "web_2" in arm.removed_vms()
    assert "web_2" not in by_name(reader(arm).read())


def _start_requests(event_id: str) -> Any:
    from emulators.imds.models import StartRequestsBody

    return StartRequestsBody.model_validate({"StartRequests": [{"EventId": event_id}]})


def test_arms_refusals_are_named_and_throttling_is_retried(arm: ImdsEmulator) -> None:
    arm.inject_arm_fault(status=429, count=2, retryAfterSeconds=0, target="read")
    assert len(reader(arm).read()) == 5, "two 429s retried by the pipeline's retry policy"
    arm.inject_arm_fault(status=403, target="read")
    with pytest.raises(CensusError, match="403: the coordinator's identity lacks the census reader role"):
        reader(arm).read()
    with pytest.raises(CensusError, match="InvalidAuthenticationTokenAudience"):
        reader(arm, credential=MintedCredential(audience="https://relay.azure.net")).read()
    # The acknowledge's faults are the acknowledge's: a read does not take them.
    arm.inject_arm_fault(status=500)
    assert len(reader(arm).read()) == 5
    assert arm.arm_status()["faultsPending"] == 1


def test_the_census_keeps_the_last_good_read_and_reads_again_by_timer_change_and_need(arm: ImdsEmulator) -> None:
    now = DOC_NOW
    census = Census(reader(arm), refresh_every=timedelta(minutes=5), min_interval=timedelta(seconds=30))
    view = census.at(now)
    assert view.usable(), "the first need reads"
    assert census.reads == 1
    assert census.at(now).facts()["web_0"].tags["tier"] == "front"

    # A tag edited in Azure: seen once the timer reads again.
    arm.update_vm("web_0", tags={"tier": "back"})
    census.refresh_if_due(now + timedelta(minutes=1))
    assert census.reads == 1
    census.refresh_if_due(now + timedelta(minutes=5))
    assert census.reads == 2
    assert census.at(now).facts()["web_0"].tags == {"tier": "back"}

    # A VM that joined: read at once when a run meets it; a name nobody has costs one read per interval at most.
    arm.add_vm({"name": "web_3", "vmScaleSetName": "web", "subscriptionId": SUBSCRIPTION,
                "resourceGroupName": "rg-fleet", "zone": "1"})  # fmt: skip
    later = now + timedelta(minutes=6)
    assert census.at(later).ensure(["web_0", "web_3"]) is True
    assert census.at(later).entry("WEB_3") is not None, "names compare as Azure's do, in any case"
    invented = [f"ghost_{n}" for n in range(1000)]
    assert census.at(later + timedelta(seconds=1)).ensure(invented) is False
    assert census.at(later + timedelta(seconds=29)).ensure(invented) is False
    assert census.reads == 3
    assert census.at(later + timedelta(seconds=31)).ensure(invented) is True  # read again, and still not there
    assert census.reads == 4
    assert len(census.at(later).entries()) == 6

    # The timer retired a VM: read at the next tick past the interval, whatever the age of the last read.
    census.membership_changed()
    census.refresh_if_due(later + timedelta(seconds=40))
    assert census.reads == 4, "9 s after the last read: held back, and still due"
    census.refresh_if_due(later + timedelta(seconds=70))
    assert census.reads == 5


def test_the_domain_index_is_built_once_a_run_asks_then_with_each_read(arm: ImdsEmulator) -> None:
    """A policy without budgets never pays for the index; once one run asked, each read builds it (off the batches'
    path), and what it holds is the read's."""
    census = Census(reader(arm), refresh_every=timedelta(minutes=5), min_interval=timedelta(seconds=30))
    assert census.at(DOC_NOW).usable()
    assert not index_built(census), "read without building the index: no run asked for it"
    first = census.at(DOC_NOW).indexed()
    assert first.members("scaleSet", "web") == {"web_0", "web_1", "web_2"}
    assert census.at(DOC_NOW).indexed() is first, "built once per read"

    arm.add_vm({"name": "web_3", "vmScaleSetName": "web", "subscriptionId": SUBSCRIPTION,
                "resourceGroupName": "rg-fleet", "zone": "1"})  # fmt: skip
    census.refresh_if_due(DOC_NOW + timedelta(minutes=5))
    assert index_built(census), "built with the read once a run asked"
    assert census.at(DOC_NOW).indexed().members("scaleSet", "web") == {"web_0", "web_1", "web_2", "web_3"}

    wanted = Census(reader(arm), index_at_read=True)  # what wiring makes for a policy whose decisions use it
    assert wanted.at(DOC_NOW).usable()
    assert index_built(wanted), "built with the first read"


def test_a_failing_arm_keeps_the_last_good_census_until_it_is_too_old(arm: ImdsEmulator) -> None:
    census = Census(reader(arm), min_interval=timedelta(seconds=30), usable_for=timedelta(minutes=15))
    assert census.at(DOC_NOW).usable()
    arm.inject_arm_fault(status=503, count=100, target="read")
    census.refresh_if_due(DOC_NOW + timedelta(minutes=5))
    assert "503" in census.error
    view = census.at(DOC_NOW + timedelta(minutes=10))
    assert view.usable(), "the last good read still decides"
    assert "web_0" in view.facts()
    old = census.at(DOC_NOW + timedelta(minutes=15))
    assert not old.usable()
    assert "not usable (last read 2022-04-11T22:11:58+00:00)" in old.why_not_usable()
    assert "503" in old.why_not_usable()


def test_a_census_never_read_is_not_usable_and_says_why(arm: ImdsEmulator) -> None:
    arm.inject_arm_fault(status=403, target="read")
    view = Census(reader(arm)).at(DOC_NOW)
    assert view.facts() == {}
    assert not view.usable()
    assert "never read" in view.why_not_usable()
    assert "403" in view.why_not_usable()


class SlowReader:
    """The ARM census reader of a slow first read: ``read`` blocks until the test lets it go."""

    scopes = ("/subscriptions/s/resourceGroups/g",)

    def __init__(self, entries: list[CensusEntry]) -> None:
        self.entries, self.reading, self.go, self.reads = entries, threading.Event(), threading.Event(), 0

    def read(self) -> list[CensusEntry]:
        self.reads += 1
        self.reading.set()
        self.go.wait(5)
        return self.entries


def test_a_run_that_needs_the_census_while_its_first_read_is_on_its_way_waits_for_it(arm: ImdsEmulator) -> None:
    """Two runs of one instance side by side: the second needs the census while the first's read is still on its
    way. It waits for that read rather than find it "never read" and hold every census rule's event."""
    slow = SlowReader(reader(arm).read())
    census = Census(slow)
    first = threading.Thread(target=lambda: census.at(DOC_NOW).entries())
    first.start()
    assert slow.reading.wait(5)
    usable: list[bool] = []
    second = threading.Thread(target=lambda: usable.append(census.at(DOC_NOW).usable()))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second run waits for the read in flight"
    slow.go.set()
    first.join(5)
    second.join(5)
    assert usable == [True]
    assert slow.reads == 1


def test_what_a_vm_says_of_itself_is_compared_with_arms_entry(arm: ImdsEmulator) -> None:
    entries = by_name(reader(arm).read())
    spec = next(s for s in arm.vms() if s.name == "web_1")
    claimed = VmIdentity.of(identity_of(spec.compute())).model_copy(
        update={"zone": "3", "tags": {"scheduled-events": "manual"}}
    )
    found = disagreements(claimed, entries["web_1"])
    assert found == {"zone": ("2", "3"), "tags": ("", "scheduled-events:manual")}
    assert describe(found) == "tags 'scheduled-events:manual' (ARM: ''); zone '3' (ARM: '2')"
    assert disagreements(claimed, None) == {"listed": ("no", "yes")}
    # Tag names compare without case, as Azure's do; an update domain an older forwarder did not send is no claim.
    spec0 = next(s for s in arm.vms() if s.name == "web_0")
    upper = VmIdentity.of(identity_of(spec0.compute())).model_copy(
        update={"tags": {"TIER": "front", "Scheduled-Events": "auto"}, "platformUpdateDomain": ""}
    )
    assert disagreements(upper, entries["web_0"]) == {}
