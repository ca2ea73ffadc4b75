"""A local run's work folder: held by one run at a time (a lock), and cleared of the previous run's files."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path
from typing import IO

from local.coordinator_setup import POLICY_COPY
from ops.history import LOCAL_RUN_FILE


class WorkdirBusy(RuntimeError):
    """Another local run holds the work folder."""


def take_workdir(workdir: Path, *, telemetry_dir: Path, folders: tuple[Path, ...]) -> IO[str]:
    """The work folder's lock (held while the returned file stays open), with the folder cleared for a new run and
    ``folders`` made; WorkdirBusy when another run holds it."""
    workdir.mkdir(parents=True, exist_ok=True)
    lock = (workdir / ".lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise WorkdirBusy(f"another local run is using {workdir}; wait for it or pass another --workdir") from None
    # A run starts clean: the previous run's history, cards, spools and logs would mix with this one's.
    for name in (
        "vms",
        "cards",
        "logs",
        "history.sqlite",
        "history.sqlite-wal",
        "history.sqlite-shm",
        LOCAL_RUN_FILE,
        POLICY_COPY,
    ):
        target = workdir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    # The previous run's spans too (only the forwarders' files: the folder is shared with the local collector).
    for spans in telemetry_dir.glob("spans-*.jsonl"):
        spans.unlink()
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    return lock
