"""Logging that neither floods nor lies: client strings escaped and cut, outages once.

``safe()`` makes any client-controlled string safe to put in a log line (one crafted
method name must not forge a second line). :class:`Outage` turns a stream of failures of
one dependency into one line when it goes, a reminder now and then, and one line when it
comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Outage", "safe"]


def safe(value: Any, limit: int = 80) -> str:
    """``value`` as a printable, single-line string of at most about ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit]
        cut = True
    else:
        cut = False
    escaped = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return escaped + ("…" if cut else "")


class Outage:
    """The up/down state of one dependency, as logged: once down, reminders, once back.

    ``failed()`` at every failed operation, ``succeeded()`` at every good one; only the
    edges and one reminder per ``remind_s`` reach the log. The way back is logged once it
    held for ``settle_s`` (a restarted server fails each stale pooled connection once: a
    flap is the same outage, not a new one). ``succeeded()`` returns True at the first
    success after failures, so that the caller re-asserts its state at once.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        remind_s: float = 60.0,
        settle_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.remind_s = remind_s
        self.settle_s = settle_s
        self.clock = clock
        self.down_since: float | None = None
        self.failures = 0  # failed operations during the current outage
        self.outages = 0  # cumulative, for the probe
        self._reminded = 0.0
        self._answering_since: float | None = None
        self.stopped = False

    def stop(self) -> None:
        """What this watches was stopped on purpose: a call still under way then fails, and
        that is no outage (nothing logged, nothing counted)."""
        self.stopped = True

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, exc: BaseException) -> None:
        if self.stopped:
            return
        now = self.clock()
        self.failures += 1
        self._answering_since = None
        if self.down_since is None:
            self.down_since = self._reminded = now
            self.outages += 1
            self.logger.error("%s unreachable: %s: %s", self.what, type(exc).__name__, safe(exc, 200))
        elif now - self._reminded >= self.remind_s:
            self._reminded = now
            self.logger.warning(
                "%s still unreachable after %.0f s (%d operations failed)",
                self.what,
                now - self.down_since,
                self.failures,
            )

    def succeeded(self) -> bool:
        if self.down_since is None:
            return False
        now = self.clock()
        first = self._answering_since is None
        if first:
            self._answering_since = now
        elif now - self._answering_since >= self.settle_s:  # type: ignore[operator]
            self.logger.warning(
                "%s reachable again after %.1f s (%d operations failed meanwhile)",
                self.what,
                self._answering_since - self.down_since,  # type: ignore[operator]
                self.failures,
            )
            self.down_since = self._answering_since = None
            self.failures = 0
        return first
