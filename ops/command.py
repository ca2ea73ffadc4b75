"""How an operator tool's ``python -m`` entry ends, the same for each."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run(main: Callable[[], int]) -> NoReturn:
    """Exits with what ``main`` returns; 141 when the reader left (e.g. ``| head``): what it did not read is not an
    error of the command."""
    try:
        sys.exit(main())
    except BrokenPipeError:
        # Python's documented way out: point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a command killed by a closed pipe
