"""A local stand-in for the Azure Instance Metadata Service: Scheduled Events (all documented api-versions,
approval, lifecycle, Terminate rules), instance metadata, managed-identity tokens, several VMs, faults and a
control API. See docs/imds-emulator.md."""

from emulators.imds.clock import Clock, ManualClock, SystemClock
from emulators.imds.models import EventCreate, FaultSpec, Scenario, ScenarioError
from emulators.imds.records import EmulatorInputError
from emulators.imds.server import VM_HEADER, ImdsEmulator
from emulators.imds.state import EmulatorState
from emulators.imds.vm_models import VmSpec

__all__ = [
    "VM_HEADER",
    "Clock",
    "EmulatorInputError",
    "EmulatorState",
    "EventCreate",
    "FaultSpec",
    "ImdsEmulator",
    "ManualClock",
    "Scenario",
    "ScenarioError",
    "SystemClock",
    "VmSpec",
]
