"""What every local emulator is as a context manager: started on entry, stopped on exit."""

from __future__ import annotations

from typing import Self


class Served:
    """A server with ``start()`` and ``stop()``; ``with`` starts it and stops it however the block ends."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
