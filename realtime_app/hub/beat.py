"""When the beat re-asserts this process's state on the backplane, and when it declares
the backplane down: one pure rule, fed with what each beat and each remote call saw.

State on a shared server is never assumed to stay (docs/reliability.md): after anything
that may have lost it — an unreachable backplane, one that answers again after an outage,
one whose check finds our keys gone — the next beat that reaches it re-asserts all of it
from the local desired state, once. A slow answer is a busy machine as often as a dead
Redis: the outage is declared by an error, or by ``SLOW_BEATS_DOWN`` slow beats in a row.
"""

from __future__ import annotations

__all__ = ["SLOW_BEATS_DOWN", "BeatRule"]

#: Beats in a row whose check of the backplane timed out before it is declared down.
SLOW_BEATS_DOWN = 2


class BeatRule:
    """The re-assert flag and the count of slow beats (no I/O, no clock)."""

    __slots__ = ("reassert", "slow_beats")

    def __init__(self) -> None:
        self.reassert = True  # a process starts by asserting everything
        self.slow_beats = 0

    def unreachable(self, *, timed_out: bool) -> bool:
        """The beat's check raised or ``timed_out``: True when the outage is declared now."""
        self.reassert = True
        self.slow_beats = self.slow_beats + 1 if timed_out else SLOW_BEATS_DOWN
        return self.slow_beats >= SLOW_BEATS_DOWN

    def answered(self, *, recovered: bool) -> None:
        """A remote call answered; ``recovered``: the first answer after an outage."""
        if recovered:
            self.reassert = True

    def reached(self, *, recovered: bool, intact: bool) -> bool:
        """The beat's check answered (``intact``: our keys are all there). True: re-assert
        everything now — the flag is spent by this beat."""
        self.slow_beats = 0
        reassert = self.reassert or recovered or not intact
        self.reassert = False
        return reassert
