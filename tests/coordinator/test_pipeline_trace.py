"""What a batch really runs, read from the interpreter (``sys.setprofile``), not from what stages say on entry
(``Run.enter``, tests/coordinator/test_pipeline_stages.py): the run enters ingest, fold and the tail once each, in
that order; fold's only calls to a later stage are the two docs/architecture.md names (decide inside its own write,
``act.send_decided`` right after it); the tail goes awaited decisions -> deliver -> cards -> budgets -> history. On
Azurite, with the IMDS emulator's listener path as in test_service."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from coordinator.pipeline.ingest import RawMessage
from tests.coordinator.helpers import envelope, scheduled_event, vm
from tests.coordinator.test_service import approvals, build, raw

PIPELINE = Path(__file__).resolve().parents[2] / "coordinator" / "pipeline"
SERVICE = PIPELINE.parent / "service.py"


def _module(frame: FrameType | None) -> str:
    """The pipeline module (or "service") a frame runs in; "" for any other code."""
    if frame is None:
        return ""
    path = Path(frame.f_code.co_filename)
    if path == SERVICE:
        return "service"
    return path.stem if path.parent == PIPELINE else ""


def calls_between_modules(run: Callable[[], object]) -> list[tuple[str, str]]:
    """Each call, on this thread, from one pipeline module (or the service) into a named function of another:
    (caller module, callee module.function)."""
    seen: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or frame.f_code.co_name.startswith(("_", "<")):
            return
        callee, caller = _module(frame), _module(frame.f_back)
        if callee not in ("", "service") and caller and caller != callee:
            seen.append((caller, f"{callee}.{frame.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def test_a_batch_enters_ingest_fold_and_the_tail_once_and_fold_calls_only_the_two_named_later_stages(
    azurite, imds, tmp_path
):
    coordinator, _, _ = build(azurite, imds, tmp_path)
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0"], NoticeSeconds=900)["EventId"]
    freeze = scheduled_event(event_id, resources=["WestNO_0"])
    messages = [
        raw(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze])),
        RawMessage(body=b"{not json", partition_key="nobody"),
    ]
    calls = calls_between_modules(lambda: coordinator.run_batch(messages))
    assert approvals(imds, event_id) == 1  # the run did what a batch does

    by = {module: [callee for caller, callee in calls if caller == module] for module, _ in calls}
    assert [callee for callee in by["service"] if callee.split(".")[0] in ("ingest", "fold", "tail")] == [
        "ingest.read_batch",
        "fold.fold",
        "tail.finish",
    ]
    later = ("act", "outbox", "record", "tail", "decide")
    from_fold = sorted({callee for callee in by["fold"] if callee.split(".")[0] in later})
    assert from_fold == [
        "act.send_decided",
        "decide.approve_together",
        "decide.decide_all",
        "decide.decide_awaiting",
        "decide.redecide_each",
        "decide.release_held",
    ]
    tail = [callee.split(".")[0] for callee in by["tail"]]
    assert tail == sorted(set(tail), key=tail.index)  # each step once
    assert [step for step in tail if step in ("act", "outbox", "decide", "release", "record")] == [
        "decide",
        "act",
        "outbox",
        "release",
        "record",
    ]
