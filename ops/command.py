"""How an operator tool's entry ends, the same for each, whether run as ``python -m ops.…`` from a checkout or as the
console command ``pip install ".[ops]"`` gives (``sefleet-policy``, ``sefleet-history``, ``sefleet-cost``,
``sefleet-drill``: pyproject.toml ``[project.scripts]``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["prog", "run"]


def prog(module: str) -> str:
    """The name a tool's usage lines show: its console command when run as one, else ``python -m module``."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return invoked if invoked.startswith("sefleet-") else f"python -m {module}"


def run(main: Callable[[], int]) -> NoReturn:
    """Exits with what ``main`` returns; 141 when the reader left (e.g. ``| head``): what it did not read is not an
    error of the command."""
    try:
        sys.exit(main())
    except BrokenPipeError:
        # Python's documented way out: point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a command killed by a closed pipe
