"""A connection's transport that always reads as over the backpressure threshold."""

from __future__ import annotations


class Overfull:
    """A connection's transport whose queue reads over any threshold (the guard drops what
    it would write); everything else is the real transport's."""

    def __init__(self, real: object) -> None:
        self.real = real

    def buffered(self) -> int:
        return 1 << 40

    def queued(self, under: int) -> int:
        return 1 << 40

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)
