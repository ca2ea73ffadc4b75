"""``Closing``: an adapter that holds connections, closed by ``close`` or at the end of a ``with`` block."""

from __future__ import annotations

from typing import Self


class Closing:
    """A base for an adapter whose ``close`` releases its connections: ``with Adapter(...) as adapter:`` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
