"""The scenario steps only the local runner plays (local/stack.py, local/platform.py), validated with the scenario:
health pages, signals to the pipeline's processes, outages, slow or dead listeners, gates, hostile senders. The
emulator passes over them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HealthPage(BaseModel):
    """A health page the local runner serves for the scenario, as a gate of its policy probes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The URL exactly as the policy's gate names it; the runner serves the page on a free port and points the
    # coordinator's copy of the policy there.
    url: str = Field(pattern=r"^http://127\.0\.0\.1:\d+/")
    status: int = Field(default=200, ge=100, le=599)  # what the page answers until a step changes it


class HealthPageStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    status: int = Field(ge=100, le=599)


class SignalStep(BaseModel):
    """For the local runner: a process of the pipeline receives a signal. ``forwarder`` (one VM's): KILL (restarted
    ``seconds`` later from the same state folder, or never with 0: a crash, or an OOM kill that systemd brings back)
    or STOP (continued ``seconds`` later: a VM paused, the process frozen). ``storage`` (Azurite, the coordinator's
    state): STOP only (a storage stall; Azure Storage does not lose what it acknowledged, and Azurite keeps it in
    memory). ``seconds`` are real seconds (the timeouts and backoffs they test are real)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: Literal["forwarder", "storage"] = "forwarder"
    vm: str | None = None
    signal: Literal["KILL", "STOP"]
    seconds: float = Field(ge=0, le=600)

    @model_validator(mode="after")
    def _fits_target(self) -> SignalStep:
        if self.target == "forwarder" and self.vm is None:
            raise ValueError("a forwarder's signal names its vm")
        if self.target == "storage" and (self.vm is not None or self.signal != "STOP"):
            raise ValueError("storage takes STOP only, and no vm")
        if self.signal == "STOP" and self.seconds <= 0:
            raise ValueError("a STOP needs seconds > 0 (the process is continued then)")
        return self


class OutageStep(BaseModel):
    """For the local runner: the Event Hubs or Relay emulator stops (every connection drops) and starts again on the
    same port ``seconds`` (real) later."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    service: Literal["eventhubs", "relay"]
    seconds: float = Field(gt=0, le=600)


class ListenerStep(BaseModel):
    """For the local runner: requests to this VM's Relay listener are held ``delaySeconds`` (real) before the
    Relay emulator delivers them (a slow listener), or never delivered (``dead``: the sender waits out its own
    deadline), for ``seconds`` (real; 0: the rest of the run). delaySeconds 0 and dead false: back to normal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vm: str
    delaySeconds: float = Field(default=0, ge=0, le=600)
    dead: bool = False
    seconds: float = Field(default=0, ge=0, le=3600)


GateBehaviour = Literal["passing", "failing", "slow", "trickle", "dead"]


class GateStep(BaseModel):
    """For the local runner: the local health page of a policy gate whose URL is ``http://local-gates/{name}``
    answers, from now on: ``passing`` (200), ``failing`` (503), ``slow`` (200 after ``delaySeconds``), ``trickle``
    (200 at once, then its body a byte at a time for ``delaySeconds``) or ``dead`` (accepts and never answers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    state: GateBehaviour
    delaySeconds: float = Field(default=0, ge=0, le=600)


# Without root on the forger's VM (no attested document), then with it (its own document; local/forgeries.py).
_Unrooted = Literal["relabel", "user", "hook", "gone", "sequence", "deep", "oversized"]
ForgeKind = (
    _Unrooted | Literal["name", "silence", "name-hook", "name-impact", "squat", "malformed", "liar", "scale-set"]
)


class ForgeStep(BaseModel):
    """For the local runner: a process on VM ``by``, holding the fleet's shared Event Hubs sender identity, sends a
    forged but well-formed envelope about the events its own IMDS shows for VM ``about``: ``relabel`` (as a 5 s
    Freeze, under ``about``'s identity, a state of its own and a huge sequence), ``user`` (claimed user-initiated,
    under its own identity), ``hook`` (``about``'s prepare hooks reported succeeded), ``gone`` (``about``'s document
    claimed empty) or ``sequence`` (a heartbeat as ``about`` with a new state and sequence 2**62); or, under its own
    identity, ``deep`` (a document nested 20,000 deep) or ``oversized`` (100 events and 50 tags of the longest names
    and values the envelope allows). With root on ``by`` (its own attested document on each envelope, issue 34):
    ``name``, ``silence``, ``name-hook``, ``name-impact``, ``squat``, ``malformed``, ``liar``, ``scale-set``
    (local/forgeries.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    by: str
    about: str
    kind: ForgeKind


# The step kinds only the local runner plays (local/stack.py, local/platform.py); the emulator validates them and
# passes over them.
LOCAL_STEP_ACTIONS = ("wipeForwarderState", "healthPage", "signal", "outage", "listener", "gate", "forge")
