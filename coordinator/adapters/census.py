"""The census from Azure Resource Manager: where each VM of the fleet sits (scale set, zone, fault and update domain,
placement group) and its tags, read with the coordinator's own identity, never from what the VMs report.

Takes the resource groups the fleet lives in; gives one ``CensusEntry`` (coordinator/domain/census.py) per VM that
exists there. Per resource group, through the project's ARM pipeline (arm.py; api-version 2025-04-01, the one
infra/modules/vmss.bicep deploys the scale set with), every list followed through its ``nextLink``:

1. ``GET {group}/providers/Microsoft.Compute/virtualMachineScaleSets``: the scale sets and their orchestration mode;
2. per Uniform scale set, ``GET {scale set}/virtualMachines?$expand=instanceView``: its instances, with ``zones``,
   ``tags`` and, in the instance view, ``platformFaultDomain``, ``platformUpdateDomain`` and ``placementGroupId``;
3. ``GET {group}/providers/Microsoft.Compute/virtualMachines?$expand=instanceView``: the Flexible scale sets' members
   (``properties.virtualMachineScaleSet``) and standalone VMs (a VM in an availability set has that set as its
   placement group), with the same facts (a Flexible member has no placement group).

A VM that ARM shows being deleted (``provisioningState`` Deleting) is left out: a percent budget counts the VMs that
will still be there. Permission: the custom role *Scheduled Events VM Census Reader* (the three ``…/read`` actions,
nothing else) on the resource group (infra/modules/vmss.bicep, docs/deploy.md). Cost: ARM reads are not billed;
each read is 2 + (Uniform scale sets) requests per resource group (more pages past a page's worth of VMs), against
ARM's and the Compute RP's read throttling (docs/coordinator.md, *The census*).

``Census`` keeps the last good read in memory for the coordinator instance (every run of the Functions worker reads
the same one) and reads again when it is older than ``refresh_every`` (the timer asks), when a run meets a VM it does
not list (a scale-out, or a name nobody listed: at most once per ``min_interval``, so a flood of invented names costs
one read per interval), and at the next need after the fleet's membership changed (``membership_changed``: the timer
retired a VM). A read that fails keeps the last good one; one older than ``usable_for`` is not usable, and decisions
that need it hold (coordinator/pipeline/decide.py).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from azure.core.credentials import TokenCredential
from azure.core.exceptions import AzureError
from azure.core.rest import HttpRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coordinator.adapters import deadline
from coordinator.adapters.arm import ArmClient, ArmOptions
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts
from coordinator.domain.fleet_view import Census as IndexedCensus

__all__ = [
    "API_VERSION",
    "ArmCensusReader",
    "Census",
    "CensusError",
    "CensusReader",
    "CensusView",
    "resource_group_id",
]

log = logging.getLogger("coordinator")

API_VERSION = "2025-04-01"
# A resource group as ARM names it: the census' scope.
_RESOURCE_GROUP = re.compile(r"^/subscriptions/[^/]+/resourceGroups/[^/]+$", re.IGNORECASE)
# Pages followed per list at most: a list that never ends (a loop of nextLinks) is an error, not a hang.
MAX_PAGES = 1000
# While the instance's first read is on its way (another run asked first), a run that needs the census waits for it
# this long at most rather than deciding without one: it would hold every census rule's event ("never read") while
# the other run approves beside it. Shorter than a batch's approval deadline (30 s).
FIRST_READ_WAIT = timedelta(seconds=10)
REFRESH_EVERY = timedelta(minutes=5)
MIN_INTERVAL = timedelta(seconds=30)
USABLE_FOR = timedelta(minutes=15)
# What each refusal means for an operator, beside ARM's own code and message.
_MEANING = {
    401: "ARM refused the coordinator's token",
    403: "the coordinator's identity lacks the census reader role on this resource group (infra/modules/vmss.bicep)",
    404: "no such resource group or scale set (COORDINATOR_CENSUS_RESOURCE_GROUPS)",
}


class CensusError(RuntimeError):
    """ARM could not be read (after the pipeline's retries), or answered something the census cannot read."""


def resource_group_id(value: str) -> str:
    """A census scope as given (``/subscriptions/{id}/resourceGroups/{name}``), or ValueError naming the form."""
    text = value.strip().rstrip("/")
    if not _RESOURCE_GROUP.match(text):
        raise ValueError(f"{value!r} is not a resource group id (/subscriptions/{{id}}/resourceGroups/{{name}})")
    return text


# ---- ARM's answers (only the fields the census reads; extra fields ignored) ----------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


_M = TypeVar("_M", bound=_Lenient)


class _SubResource(_Lenient):
    id: str = ""


class _InstanceView(_Lenient):
    platformUpdateDomain: int | None = None
    platformFaultDomain: int | None = None
    placementGroupId: str = ""


class _VmProperties(_Lenient):
    vmId: str = ""
    provisioningState: str = ""
    virtualMachineScaleSet: _SubResource | None = None
    availabilitySet: _SubResource | None = None
    platformFaultDomain: int | None = None
    instanceView: _InstanceView | None = None


class _Vm(_Lenient):
    name: str = Field(min_length=1)
    id: str = Field(min_length=1)
    location: str = ""
    zones: list[str] = Field(default_factory=list)
    tags: dict[str, str] = Field(default_factory=dict)
    properties: _VmProperties = Field(default_factory=_VmProperties)


class _ScaleSetProperties(_Lenient):
    orchestrationMode: str = "Uniform"


class _ScaleSet(_Lenient):
    name: str = Field(min_length=1)
    id: str = Field(min_length=1)
    properties: _ScaleSetProperties = Field(default_factory=_ScaleSetProperties)


class _Page(_Lenient):
    value: list[dict[str, Any]] = Field(default_factory=list)
    nextLink: str | None = None


def _last(resource_id: str) -> str:
    return resource_id.rstrip("/").rsplit("/", 1)[-1] if resource_id else ""


def _number(value: int | None) -> str:
    # IMDS serves domains as strings of digits; the census keeps them the same way (VmFacts.domain's keys).
    return "" if value is None else str(value)


def _entry(vm: _Vm, *, scale_set: str) -> CensusEntry:
    view = vm.properties.instanceView or _InstanceView()
    fault = view.platformFaultDomain if view.platformFaultDomain is not None else vm.properties.platformFaultDomain
    if scale_set:
        # A Uniform instance's placement group is in its instance view; a Flexible member has none.
        placement = view.placementGroupId
    else:
        placement = _last(vm.properties.availabilitySet.id) if vm.properties.availabilitySet else ""
    return CensusEntry(
        name=vm.name,
        vmId=vm.properties.vmId,
        resourceId=vm.id,
        facts=VmFacts(
            scaleSet=scale_set,
            zone=vm.zones[0] if vm.zones else "",
            location=vm.location,
            faultDomain=_number(fault),
            updateDomain=_number(view.platformUpdateDomain),
            placementGroup=placement,
            tags=dict(vm.tags),
        ),
    )


class CensusReader(Protocol):
    """Reads the census whole: every VM of its scopes as ARM lists it now. Raises ``CensusError``."""

    @property
    def scopes(self) -> Sequence[str]: ...

    def read(self) -> list[CensusEntry]: ...


class ArmCensusReader:
    """``CensusReader`` over ARM's Compute lists (module docstring), with the coordinator's identity.

    :keyword resource_groups: the scopes, as resource group ids.
    :keyword arm: how ARM is called (its root: the IMDS emulator's ARM face locally; retries; each call's
        deadline, which bounds each page of a list)."""

    def __init__(
        self,
        *,
        credential: TokenCredential,
        resource_groups: Sequence[str],
        arm: ArmOptions | None = None,
    ) -> None:
        if not resource_groups:
            raise ValueError("the census needs at least one resource group")
        self._groups = tuple(resource_group_id(group) for group in resource_groups)
        self._client = ArmClient(credential=credential, moniker="census", options=arm)

    @property
    def scopes(self) -> Sequence[str]:
        return self._groups

    def close(self) -> None:
        self._client.close()

    def read(self) -> list[CensusEntry]:
        entries: list[CensusEntry] = []
        for group in self._groups:
            compute = f"{group}/providers/Microsoft.Compute"
            for item in self._pages(f"{compute}/virtualMachineScaleSets?api-version={API_VERSION}"):
                scale_set = self._model(_ScaleSet, item)
                if scale_set.properties.orchestrationMode.lower() != "uniform":
                    continue  # a Flexible scale set's members are VMs of their own: listed below
                path = f"{compute}/virtualMachineScaleSets/{quote(scale_set.name, safe='')}/virtualMachines"
                for vm in self._pages(f"{path}?$expand=instanceView&api-version={API_VERSION}"):
                    entries.extend(self._listed(vm, scale_set=scale_set.name))
            for vm in self._pages(f"{compute}/virtualMachines?$expand=instanceView&api-version={API_VERSION}"):
                entries.extend(self._listed(vm, scale_set=None))
        return entries

    def _listed(self, item: dict[str, Any], *, scale_set: str | None) -> list[CensusEntry]:
        vm = self._model(_Vm, item)
        if vm.properties.provisioningState.lower() == "deleting":
            return []
        owner = scale_set if scale_set is not None else _last(getattr(vm.properties.virtualMachineScaleSet, "id", ""))
        return [_entry(vm, scale_set=owner)]

    @staticmethod
    def _model(model: type[_M], item: dict[str, Any]) -> _M:
        try:
            return model.model_validate(item)
        except ValidationError as error:
            raise CensusError(f"ARM listed a {model.__name__.strip('_')} the census cannot read: {error}") from error

    def _pages(self, url: str) -> Iterator[dict[str, Any]]:
        next_url: str | None = url
        for _page in range(MAX_PAGES):
            if next_url is None:
                return
            try:
                response = self._client.send(HttpRequest("GET", next_url))
            except AzureError as error:  # raised only once the retry policy gave up
                raise CensusError(f"ARM GET {next_url} failed: {error.message}") from error
            except deadline.DeadlineExceeded as error:
                raise CensusError(str(error)) from error
            if response.status_code != 200:
                raise CensusError(
                    f"ARM GET {next_url} answered {response.status_code}: "
                    f"{_MEANING.get(response.status_code, 'unexpected answer')}: {response.text()[:300]}"
                )
            try:
                page = _Page.model_validate_json(response.content)
            except ValidationError as error:
                raise CensusError(f"ARM GET {next_url}: not a list page: {error}") from error
            yield from page.value
            next_url = page.nextLink
        raise CensusError(f"ARM GET {url}: more than {MAX_PAGES} pages")


# ---- the census kept by one coordinator instance -----------------------------------------------------------------


@dataclass
class _Snapshot:
    entries: Mapping[str, CensusEntry] = field(default_factory=dict)  # by name, lower case
    read_at: datetime | None = None
    by_resource: Mapping[str, CensusEntry] = field(default_factory=dict)  # by resource id, lower case
    # By domain, set once (under the lock): with the read (off the batches' path) once wanted, else by the first
    # run that asks (a policy without budgets never pays ~1 s of CPU and tens of MB a read of a 100k fleet).
    indexed: IndexedCensus | None = None


class Census:
    """The last good census read, shared by the runs of one coordinator instance (module docstring: when it is read
    again). Thread-safe: a read happens outside the lock, and its result replaces the snapshot whole."""

    def __init__(
        self,
        reader: CensusReader,
        *,
        refresh_every: timedelta = REFRESH_EVERY,
        min_interval: timedelta = MIN_INTERVAL,
        usable_for: timedelta = USABLE_FOR,
        index_at_read: bool = False,
    ) -> None:
        """``index_at_read``: the domain index built with every read (else from the first run that asks for it)."""
        if not min_interval <= refresh_every < usable_for:
            raise ValueError("the census needs min_interval <= refresh_every < usable_for")
        self._reader = reader
        self.refresh_every = refresh_every
        self.min_interval = min_interval
        self.usable_for = usable_for
        self._snapshot = _Snapshot()
        self._lock = threading.Lock()
        self._attempted: datetime | None = None
        self._reading: threading.Event | None = None  # set once the read in flight ends
        self._stale = False
        self._index_wanted = index_at_read  # a run asked for the index: later reads build it with the read
        self.error = ""  # why the last read failed; "" after a good one
        self.reads = 0

    @property
    def scopes(self) -> Sequence[str]:
        return self._reader.scopes

    def at(self, now: datetime) -> CensusView:
        """The census as one run at ``now`` sees it."""
        return CensusView(self, now)

    def membership_changed(self) -> None:
        """VMs left the fleet (the timer retired them) or joined: read again at the next need."""
        with self._lock:
            self._stale = True

    def refresh_if_due(self, now: datetime) -> None:
        """The timer's part: a read when the last good one is older than ``refresh_every``, or after a membership
        change, or when there is none yet."""
        snapshot = self._snapshot
        if self._stale or snapshot.read_at is None or now - snapshot.read_at >= self.refresh_every:
            self.refresh(now, why="timer" if not self._stale else "membership changed")

    def refresh(self, now: datetime, *, why: str) -> bool:
        """Reads ARM now unless another read was attempted less than ``min_interval`` ago (the first read is never
        held back; while it is on its way, another caller waits for it, ``FIRST_READ_WAIT`` at most). True when a
        good read replaced the census."""
        with self._lock:
            in_flight = self._reading if self._snapshot.read_at is None else None
            first = self._snapshot.read_at is None and self._attempted is None
            limited = self._attempted is not None and now - self._attempted < self.min_interval
            if in_flight is None and not first and limited:
                return False
            if in_flight is None:
                self._attempted, self._stale = now, False
                self._reading = threading.Event()
        if in_flight is not None:
            in_flight.wait(FIRST_READ_WAIT.total_seconds())
            return False  # another caller's read: the snapshot is what it left
        try:
            return self._read(now, why=why)
        finally:
            with self._lock:
                done, self._reading = self._reading, None
            if done is not None:
                done.set()

    def _read(self, now: datetime, *, why: str) -> bool:
        try:
            entries = self._reader.read()
        except Exception as error:  # kept as the reason; the last good census stays in use while it is usable
            log.warning("census: reading ARM failed (%s): %s", why, error)
            with self._lock:
                self.error = f"{type(error).__name__}: {str(error)[:500]}"
            return False
        by_name: dict[str, CensusEntry] = {}
        by_resource: dict[str, CensusEntry] = {}
        for entry in entries:
            by_name.setdefault(entry.name.lower(), entry)
            by_resource.setdefault(entry.resourceId.lower(), entry)
        indexed = IndexedCensus((e.name, e.facts) for e in by_name.values()) if self._index_wanted else None
        with self._lock:
            self._snapshot = _Snapshot(entries=by_name, read_at=now, by_resource=by_resource, indexed=indexed)
            self.error = ""
            self.reads += 1
        log.info("census: %d VMs in %s read from ARM (%s)", len(by_name), ", ".join(self.scopes), why)
        return True

    def snapshot(self) -> tuple[Mapping[str, CensusEntry], datetime | None]:
        snapshot = self._snapshot
        return snapshot.entries, snapshot.read_at

    def snapshot_by_resource(self) -> Mapping[str, CensusEntry]:
        return self._snapshot.by_resource

    def snapshot_indexed(self) -> IndexedCensus:
        snapshot = self._snapshot
        if snapshot.indexed is None:
            # Outside the lock: two runs asking at once build it twice, one kept.
            built = IndexedCensus((e.name, e.facts) for e in snapshot.entries.values())
            with self._lock:
                self._index_wanted = True
                if snapshot.indexed is None:
                    snapshot.indexed = built
        return snapshot.indexed


class CensusView:
    """The census for one run at one instant: the first need reads ARM if nothing was read yet; ``ensure`` reads
    again (rate-limited) for VMs it does not list."""

    def __init__(self, census: Census, now: datetime) -> None:
        self.census = census
        self.now = now

    def entries(self) -> Mapping[str, CensusEntry]:
        """The VMs ARM lists, by name in lower case."""
        entries, read_at = self.census.snapshot()
        if read_at is None:
            self.census.refresh(self.now, why="first need")
            entries, _ = self.census.snapshot()
        return entries

    def entry(self, name: str) -> CensusEntry | None:
        return self.entries().get(name.lower())

    def entry_of_resource(self, resource_id: str) -> CensusEntry | None:
        """The VM ARM lists under ``resource_id`` (any case), from the last good read (read first if none yet)."""
        self.entries()
        return self.census.snapshot_by_resource().get(resource_id.lower())

    def facts(self) -> dict[str, VmFacts]:
        """Every listed VM's facts, by its name as ARM spells it."""
        return {entry.name: entry.facts for entry in self.entries().values()}

    def indexed(self) -> IndexedCensus:
        """The same facts indexed by budget domain (made by the first run that asks, then with each read; read,
        never changed)."""
        self.entries()
        return self.census.snapshot_indexed()

    def ensure(self, names: Iterable[str]) -> bool:
        """Reads ARM again when one of ``names`` is not listed (a VM that joined since the last read; or a name no
        VM has, which the rate limit makes cheap). True when it read ARM again."""
        listed = self.entries()
        missing = sorted({name for name in names if name.lower() not in listed})
        if not missing:
            return False
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return self.census.refresh(self.now, why=f"not listed yet: {shown}")

    def usable(self) -> bool:
        """Whether the census may be decided on: a good read no older than ``usable_for``."""
        self.entries()
        _, read_at = self.census.snapshot()
        return read_at is not None and self.now - read_at < self.census.usable_for

    def why_not_usable(self) -> str:
        _, read_at = self.census.snapshot()
        since = f"last read {read_at.isoformat()}" if read_at is not None else "never read"
        error = f": {self.census.error}" if self.census.error else ""
        return f"the census from ARM ({', '.join(self.census.scopes)}) is not usable ({since}){error}"
