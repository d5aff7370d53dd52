"""Adaptive cadence on the client side (docs/clients.md): AIMD on the gaps between frames.

The Python twin of ``AdaptiveRate`` in ``static/realtime_app/realtime.js``; both pass
the same JSON test vectors. Pure: times are numbers in ms handed in by the caller, so
the scenario replay drives it on a controlled clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

__all__ = ["AdaptiveRate", "Decision", "derive_ladder"]

Decision: TypeAlias = Literal["slower", "faster"] | None

DEFAULT_MAX_MS = 60000
STARVATION_FACTOR = 1.8
HEALTHY_FACTOR = 1.25
RECOVERY_WINDOW = 4


def derive_ladder(interval_ms: int, max_ms: int = DEFAULT_MAX_MS) -> list[int]:
    """Double the desired cadence up to ``max_ms``: 1000 → [1000, 2000, …, 32000, 60000]."""
    if interval_ms <= 0:
        raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
    ladder = [interval_ms]
    while ladder[-1] * 2 < max_ms:
        ladder.append(ladder[-1] * 2)
    if ladder[-1] < max_ms:
        ladder.append(max_ms)
    return ladder


class AdaptiveRate:
    """Decides, one frame at a time, whether to ask for a slower or faster cadence.

    Args:
        interval_ms: the desired cadence: never faster than this.
        max_ms: top of the derived ladder (ignored with ``ladder``).
        ladder: explicit cadences; rungs under ``interval_ms`` are ignored.
        starvation_factor: a gap over this × cadence steps slower at once.
        healthy_factor: a gap at most this × cadence is healthy.
        recovery_window: healthy gaps in a row needed to step one rung faster.
        enabled: False means a fixed cadence: no measuring, no decisions.
    """

    def __init__(
        self,
        interval_ms: int,
        *,
        max_ms: int = DEFAULT_MAX_MS,
        ladder: Sequence[int] | None = None,
        starvation_factor: float = STARVATION_FACTOR,
        healthy_factor: float = HEALTHY_FACTOR,
        recovery_window: int = RECOVERY_WINDOW,
        enabled: bool = True,
    ) -> None:
        if not 1 <= healthy_factor < starvation_factor:
            raise ValueError(
                f"need 1 <= healthy_factor < starvation_factor, got {healthy_factor} and {starvation_factor}"
            )
        if recovery_window < 1:
            raise ValueError(f"recovery_window must be >= 1, got {recovery_window}")
        if ladder is None:
            rungs = derive_ladder(interval_ms, max_ms)
        else:
            rungs = sorted({int(r) for r in ladder if r >= interval_ms} | {interval_ms})
        self.desired_ms = interval_ms
        self.ladder = rungs
        self.starvation_factor = starvation_factor
        self.healthy_factor = healthy_factor
        self.recovery_window = recovery_window
        self.enabled = enabled
        self._index = 0
        self._last: float | None = None  # time of the reference frame
        self._since: float | None = None  # time of the last change (watchdog reference)
        self._healthy = 0

    @property
    def interval_ms(self) -> int:
        """The cadence to subscribe to now."""
        return self.ladder[self._index]

    @property
    def healthy_count(self) -> int:
        return self._healthy

    def reset(self, now: float | None = None) -> None:
        """Restart the measurement: the next frame is only a reference."""
        self._last = None
        self._since = now
        self._healthy = 0

    def _step(self, delta: int, now: float) -> Decision:
        self._index += delta
        self.reset(now)
        return "slower" if delta > 0 else "faster"

    def note_frame(self, now: float) -> Decision:
        """Record a frame received at ``now`` (ms); returns the decision it leads to."""
        if not self.enabled:
            return None
        last, self._last = self._last, now
        if last is None:
            self._since = now
            return None
        gap = now - last
        cadence = self.interval_ms
        if gap > self.starvation_factor * cadence:
            self._healthy = 0
            return self._step(1, now) if self._index < len(self.ladder) - 1 else None
        if gap <= self.healthy_factor * cadence:
            self._healthy += 1
            if self._healthy >= self.recovery_window:
                self._healthy = 0
                if self._index > 0:
                    return self._step(-1, now)
            return None
        self._healthy = 0  # dead band: no change, and the healthy run is broken
        return None

    def check_starvation(self, now: float) -> Decision:
        """Watchdog: with no frame for too long, step slower even though nothing arrives."""
        if not self.enabled:
            return None
        reference = self._last if self._last is not None else self._since
        if reference is None:
            self._since = now
            return None
        if now - reference > self.starvation_factor * self.interval_ms and self._index < len(self.ladder) - 1:
            return self._step(1, now)
        return None
