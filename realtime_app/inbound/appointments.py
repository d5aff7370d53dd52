"""When the clients of a refused crowd come back: one after another, at the rate the refused
resource frees up (the process's handshake bucket refilling, its resume slots turning
over), each told its own ``retry_after_ms`` instead of one delay for all.

A crowd told "in a second" comes back as a crowd a second later, and most of it is refused
again: after a deploy, the clients of a stopped process were refused their resumes round
after round (``bench/deploy.py``). Pure: the caller passes the time and the draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Appointments"]


@dataclass(slots=True)
class Appointments:
    """The turns given to refused clients of one resource; ``horizon_s``: the furthest turn
    given one by one (past it a crowd is spread at random up to it, the book unmoved: a
    flood that outlasts the horizon does not push honest clients ever later)."""

    horizon_s: float
    last: float = -math.inf  # the latest turn given, on the caller's clock

    def next(self, now: float, spacing_s: float, earliest_s: float, u: float) -> float:
        """Seconds from ``now`` until the next refused client's turn: ``spacing_s`` after the
        turn given before it and ``earliest_s`` from now at the soonest; when that is past
        the horizon, a point between ``earliest_s`` and the horizon (``u`` uniform in [0, 1))."""
        wait = max(earliest_s, self.last + spacing_s - now)
        if wait > self.horizon_s + 1e-9:
            return max(earliest_s, earliest_s + u * (self.horizon_s - earliest_s))
        self.last = now + wait
        return wait

    def next_ms(self, now: float, spacing_s: float, earliest_s: float, u: float) -> int:
        """:meth:`next` as a close reason's or an error's ``retry_after_ms`` (1 at least)."""
        return max(1, math.ceil(round(self.next(now, spacing_s, earliest_s, u) * 1000, 6)))
