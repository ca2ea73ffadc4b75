"""How the local pipeline runs (``StackOptions``), and the clock tolerance every process of it is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coordinator import DEFAULT_POLICY_PATH
from emulators.imds import Scenario
from emulators.imds.lifecycle import DEFAULT_STARTED_MIN_SECONDS
from local.easy_auth import DEFAULT_PEOPLE, LocalPerson
from local.host import HostProcessOptions
from local.runner import IngestFunction

# Seconds the coordinator and the listeners allow their clocks to disagree: one clock here (2 s in Azure).
LOCAL_CLOCK_TOLERANCE = 0.25


@dataclass(frozen=True)
class StackOptions:
    """How the local pipeline runs. Times are real seconds unless named otherwise."""

    scenario: Scenario
    workdir: Path = Path(".local")
    time_scale: float = 60.0
    lead_in: float = 3.0  # real seconds before the scenario's first step: the forwarders start meanwhile
    poll_interval: float = 1.0
    heartbeat_interval: float = 5.0
    timer_interval: float = 2.0
    prepare_hooks: bool = True
    policy_path: Path | None = None
    throttle_rps: float = 5.0
    relay: bool = True
    forwarder_log_level: str = "INFO"
    coordinator_env: dict[str, str] = field(default_factory=dict)
    # Tests wrap the trigger to replay the host's misbehaviours (a batch delivered twice, two instances at once).
    ingest_wrapper: Callable[[IngestFunction], IngestFunction] | None = None
    # The people's pages (approval page, open events) on 127.0.0.1: this port (0: any free one), and who can sign
    # in at the stand-in of App Service Authentication, with which app roles.
    http_port: int = 0
    people: tuple[LocalPerson, ...] = DEFAULT_PEOPLE
    # Azure seconds a Started event stays listed at least (the docs' ~10 minutes). A run at a low time scale may
    # shorten it: at 10x the default keeps every started event in the documents for a minute of real time.
    started_min_seconds: float = DEFAULT_STARTED_MIN_SECONDS
    # The function host in a process of its own, which a test may SIGKILL and start again (local/host_process.py).
    coordinator_process: HostProcessOptions | None = None

    @property
    def policy(self) -> Path:
        """The run's approval policy: ``policy_path`` (``--policy``), else the scenario's own, else the default."""
        if self.policy_path is not None:
            return self.policy_path
        return Path(self.scenario.policy) if self.scenario.policy is not None else DEFAULT_POLICY_PATH

    @property
    def scenario_policy(self) -> bool:
        """Whether the run uses the policy the scenario names, for which its ``expect``s are written."""
        own = self.scenario.policy
        return own is not None and self.policy.resolve() == Path(own).resolve()
