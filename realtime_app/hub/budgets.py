"""Bytes an identity keeps on a shared server for a while (an idempotent answer, a fresh
channel's count and epoch), each until its own expiry: one book for every per-identity
byte bound, so that each expires at its own time and a quiet identity is forgotten."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable

__all__ = ["ExpiringBytes"]


class ExpiringBytes:
    """Per identity, the bytes kept now; the caller gives the time (its own clock)."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, int, Hashable, int]] = []  # (expiry, n, identity, bytes), a heap
        self.bytes: dict[Hashable, int] = {}  # per identity, what is kept now
        self._order = itertools.count()

    def add(self, identity: Hashable, nbytes: int, expires: float) -> None:
        heapq.heappush(self.entries, (expires, next(self._order), identity, nbytes))
        self.bytes[identity] = self.bytes.get(identity, 0) + nbytes

    def expire(self, now: float) -> None:
        """Forget what expired by ``now``, whoever kept it."""
        entries = self.entries
        while entries and entries[0][0] <= now:
            _, _, identity, nbytes = heapq.heappop(entries)
            left = self.bytes.get(identity, 0) - nbytes
            if left > 0:
                self.bytes[identity] = left
            else:
                self.bytes.pop(identity, None)

    def of(self, identity: Hashable, now: float) -> int:
        self.expire(now)
        return self.bytes.get(identity, 0)

    def total(self, now: float) -> int:
        self.expire(now)
        return sum(self.bytes.values())

    def first_expiry(self, identity: Hashable) -> float | None:
        """When the first of ``identity``'s bytes expires (a refusal's question: rare, so a walk)."""
        return min((at for at, _, who, _ in self.entries if who == identity), default=None)
