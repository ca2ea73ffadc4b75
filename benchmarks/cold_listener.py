"""The price of an on-demand listener: how long an approval takes when the VM's listener was not connected.

    .venv/bin/python -m benchmarks.cold_listener [--n 20] [--mode on-demand|always-on|both]

The real race, on loopback: a real `python -m forwarder run` process (relay listener on demand, 1 poll/s, envelopes
to a JSON-lines file) polls the IMDS emulator; an event is created there; the moment the forwarder's envelope
listing it is written (the forwarder has seen it, and has started connecting its listener), the coordinator's
``RelayApprovalSender`` sends the approval — the request the coordinator would send if it decided at once
(``benchmarks.approval_latency.approval_request``: notAfter from ``coordinator.domain.expiry``) — and the clock runs
until the listener's answer (approved, through the Relay emulator and IMDS). Then the event starts, the listener
leaves after its grace period (0.5 s here), and the next trial begins with no listener connected.

The default measures the on-demand listener alone (``listener: "on-demand"``). With ``--mode both`` the same
trials run against an always-on listener too (``warm_listener: "connected"``), and ``cold_listener_extra_ms_p50/p99``
is the difference: the cost of connecting on demand (``--mode always-on``: that one alone, ``listener:
"connected"``). Prints one JSON object: cold_listener_approval_ms_p50/p99/max (the on-demand figures),
warm_listener_approval_ms_p50/p99/max, n, samples, and ``problems`` (exit 1 when not empty): an approval not
answered "approved" or not recorded by IMDS for its event and VM, the listener in another mode than the one measured
(on demand: connected before the event, not once per event, or never leaving; always-on: not connected, or
connecting again), the forwarder exiting, fewer samples than asked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from azure.core.credentials import AzureNamedKeyCredential

from benchmarks.approval_latency import approval_request, percentile
from benchmarks.checks import approvals_problems, finish, too_few
from contracts.envelope import VmIdentity
from coordinator import ApprovalDeliveryError, RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from forwarder.imds import ImdsClient

ROOT = Path(__file__).resolve().parents[1]
KEY = "Y29sZC1saXN0ZW5lci1iZW5jaA=="
GRACE_SECONDS = 0.5
REFILL_SECONDS = 3.0
# A day of notice, 144 real seconds at 600x: the request is valid for the seconds of its delivery, well inside it.
NOTICE_SECONDS = 86_400


class Timeout(Exception):
    """A wait that did not end: what the trial waited for did not happen."""


def wait(predicate: Any, *, timeout: float, what: str, step: float = 0.002) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise Timeout(f"timed out after {timeout:g} s waiting for {what}")


def seen_scheduled(envelopes: Path, event_id: str) -> bool:
    """Whether the forwarder has written an envelope listing the event as Scheduled (its poll saw it). Whole lines
    only: the forwarder may be part way through writing one (a large envelope leaves its buffer in pieces)."""
    if not envelopes.exists():
        return False
    text = envelopes.read_text(encoding="utf-8")
    for line in text[: text.rfind("\n") + 1].splitlines()[-5:]:
        document = json.loads(line).get("document") or {}
        if any(e["EventId"] == event_id and e["EventStatus"] == "Scheduled" for e in document.get("Events", [])):
            return True
    return False


@dataclass
class Trials:
    """One mode's trials: the timings and what the run recorded against them."""

    mode: str
    timings: list[float] = field(default_factory=list)
    expected: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def trials(n: int, *, mode: str, forwarder_mode: str | None = None) -> Trials:
    """``n`` approvals to a real forwarder whose listener is ``mode`` (on-demand or always-on). ``forwarder_mode``
    (tests only) starts the forwarder in another mode than the one the trials claim to measure."""
    done = Trials(mode=mode)
    relay = RelayEmulator(sas_keys={"send": KEY})
    relay.start()
    # Emulated time runs 600x (a day of notice is 144 s): approved events finish and leave the document quickly.
    with tempfile.TemporaryDirectory() as scratch, ImdsEmulator(time_scale=600, throttle_rps=0) as imds:
        vm = imds.first_vm
        envelopes = Path(scratch) / "envelopes.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
        env.update(
            SE_FORWARDER_IMDS_URL=imds.url_for(vm),
            SE_FORWARDER_STATE_DIR=str(Path(scratch) / "state"),
            SE_FORWARDER_HOOKS_DIR=str(Path(scratch) / "hooks"),
            SE_FORWARDER_SINK="jsonl",
            SE_FORWARDER_JSONL_PATH=str(envelopes),
            SE_FORWARDER_RELAY_ENABLED="true",
            SE_FORWARDER_RELAY_ENDPOINT=relay.ws_url,
            SE_FORWARDER_RELAY_LISTENER_MODE=forwarder_mode or mode,
            SE_FORWARDER_RELAY_LISTENER_GRACE_SECONDS=str(GRACE_SECONDS),
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "forwarder", "run"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The production sender (its "no listener" retries capped at 1 s), with a SAS key for the emulator.
        sender = RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", KEY))
        try:
            client = ImdsClient(base_url=imds.url_for(vm))
            identity = VmIdentity.of(client.get_identity())
            client.close()
            run_trials(n, done, Rig(imds=imds, relay=relay, sender=sender, vm=identity, envelopes=envelopes))
            if process.poll() is not None:
                done.problems.append(f"the forwarder exited with {process.returncode} during the {mode} trials")
            done.problems += approvals_problems(imds.approvals(), done.expected)
        finally:
            sender.close()
            process.terminate()
            process.wait(15)
            relay.stop()
    done.problems += too_few(f"{mode} approvals", len(done.timings), n)
    return done


@dataclass
class Rig:
    """What the trials run against: the emulators, the coordinator's sender, the VM, its forwarder's envelopes."""

    imds: ImdsEmulator
    relay: RelayEmulator
    sender: RelayApprovalSender
    vm: VmIdentity
    envelopes: Path

    @property
    def listeners(self) -> int:
        return self.relay.listener_count(self.vm.hybrid_connection_name)

    @property
    def connections(self) -> int:
        """How many times a listener connected to the VM's hybrid connection so far."""
        return self.relay.counters().get(f"listener.{self.vm.hybrid_connection_name.lower()}", 0)

    def left(self, what: str) -> None:
        """Waits for the on-demand listener to leave (its grace after its last event)."""
        wait(lambda: self.listeners == 0, timeout=max(10.0, 10 * GRACE_SECONDS), what=what, step=0.05)


def run_trials(n: int, done: Trials, rig: Rig) -> None:
    """The trials, one after another; the first that cannot go on as the mode says ends them, named in problems."""
    try:
        if done.mode == "always-on":
            wait(lambda: rig.listeners == 1, timeout=30, what="the always-on listener to connect")
        for index in range(n):
            if not trial(index, done, rig):
                return
        if done.mode == "on-demand":  # and it leaves once its last event is gone
            rig.left("the listener to leave after its last event (it is not on demand)")
        elif rig.listeners != 1:
            done.problems.append("the always-on listener was not connected after the trials")
    except Timeout as error:
        done.problems.append(f"{done.mode} trials stopped after {len(done.timings)}: {error}")


def trial(index: int, done: Trials, rig: Rig) -> bool:
    """One approval, timed; False when the listener is not in the mode measured and the trials cannot go on."""
    mode = done.mode
    if mode == "on-demand":
        rig.left("the listener to leave after its grace (it is not on demand)")
    elif rig.listeners != 1:
        done.problems.append(f"trial {index}: the always-on listener was not connected")
    # The forwarder's IMDS rate limiter (forwarder/retry.py: 4 in any second, shared by the poll, the attestor, the
    # relay token and the approver); back-to-back approvals would fill its window and measure the limiter, so each
    # trial starts with it empty, as a VM's rare approval does.
    time.sleep(REFILL_SECONDS)
    if mode == "on-demand" and rig.listeners != 0:
        done.problems.append(f"trial {index}: the listener connected before any event (not on demand)")
        return False
    connected_before = rig.connections
    created = rig.imds.create_event(EventType="Freeze", Resources=[rig.vm.name], NoticeSeconds=NOTICE_SECONDS)
    event_id = str(created["EventId"])
    wait(lambda: seen_scheduled(rig.envelopes, event_id), timeout=30, what="the forwarder to see the event")
    request = approval_request(created, decision_id=f"cold-{mode}-{index}", now=datetime.now(UTC))
    if request is None:
        done.problems.append(f"trial {index}: the coordinator would not send this approval (notAfter)")
        return True
    done.expected[event_id] = [rig.vm.name]
    started = time.perf_counter()
    try:
        result = rig.sender.send(request, vm=rig.vm)
    except ApprovalDeliveryError as error:
        done.problems.append(f"trial {index} ({mode}): not delivered: {str(error)[:300]}")
        return True
    took = (time.perf_counter() - started) * 1000
    if result.outcome != "approved":
        done.problems.append(f"trial {index} ({mode}) was {result.outcome}: {result.reason[:300]}")
        return True
    opened = rig.connections - connected_before
    if mode == "on-demand" and opened != 1:
        done.problems.append(
            f"trial {index}: the listener connected {opened} times for the event, not once (on demand)"
        )
    if mode == "always-on" and opened != 0:
        done.problems.append(f"trial {index}: the always-on listener connected again ({opened} times)")
    done.timings.append(took)
    return True


def figures(prefix: str, timings: list[float]) -> dict[str, float]:
    if not timings:
        return {}
    return {
        f"{prefix}_approval_ms_p50": round(statistics.median(timings), 1),
        f"{prefix}_approval_ms_p99": round(percentile(timings, 0.99), 1),
        f"{prefix}_approval_ms_max": round(max(timings), 1),
    }


def run(n: int, *, mode: str = "on-demand", forwarder_mode: str | None = None) -> dict[str, Any]:
    """``forwarder_mode`` (tests only): the forwarder's listener mode when it is not the one measured."""
    result: dict[str, Any] = {"n": n, "grace_seconds": GRACE_SECONDS, "listener": "on-demand"}
    problems: list[str] = []
    if mode in ("on-demand", "both"):
        cold = trials(n, mode="on-demand", forwarder_mode=forwarder_mode)
        # An invalid run's timings are no figures (e.g. an always-on listener slow to connect, timed as if on demand,
        # then found connected after the trials).
        result |= (figures("cold_listener", cold.timings) if not cold.problems else {}) | {"samples": len(cold.timings)}
        problems += cold.problems
    if mode in ("always-on", "both"):
        warm = trials(n, mode="always-on", forwarder_mode=forwarder_mode)
        result |= (figures("warm_listener", warm.timings) if not warm.problems else {}) | {
            "warm_samples": len(warm.timings)
        }
        result["warm_listener"] = "connected"
        problems += warm.problems
    if mode == "always-on":
        result["listener"] = "connected"
    if mode == "both" and not problems:
        for stat in ("p50", "p99"):
            extra = result[f"cold_listener_approval_ms_{stat}"] - result[f"warm_listener_approval_ms_{stat}"]
            result[f"cold_listener_extra_ms_{stat}"] = round(extra, 1)
    return result | {"problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_listener", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="approvals per mode (default 20)")
    parser.add_argument("--mode", choices=("on-demand", "always-on", "both"), default="on-demand")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    logging.basicConfig(level=logging.ERROR)
    return finish(lambda: run(args.n, mode=args.mode))


if __name__ == "__main__":
    raise SystemExit(main())
