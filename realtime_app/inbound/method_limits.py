"""Limits of one method for one identity, beside the identity's own (docs/admission.md):
calls of that method in flight (``rpc_method(max_in_flight=)``) and calls a second
(``rpc_method(rate=, burst=)``, a token bucket). Pure: no loop, a clock passed in.

An expensive method (an export, a search) is limited on its own, without lowering the
identity's whole budget: past its limit a call is refused -32004 ``too_many_in_flight``
or -32005 ``rate_limited`` with ``retry_after_ms`` (exact for the bucket), like the
identity's own refusals. Memory follows the identities that call: books of idle
identities are forgotten once they are full again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

from realtime_app.inbound.admission import Refusal
from realtime_app.wire.protocol import RATE_LIMITED, TOO_MANY_IN_FLIGHT

__all__ = ["MethodLimits"]

#: Books kept before the idle ones are swept.
SWEEP_OVER = 10_000
#: How soon a caller at its in-flight limit may try again, ms (one call's end is not known).
IN_FLIGHT_RETRY_MS = 250

Key = tuple[str, Hashable]


class MethodLimits:
    """The in-flight counts and buckets of every (method, identity) that has limits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.in_flight: dict[Key, int] = {}
        self.buckets: dict[Key, tuple[float, float, float, float]] = {}  # (tokens, when, rate, capacity)

    def take(
        self, method: str, identity: Hashable, max_in_flight: int = 0, rate: float = 0.0, burst: int = 0
    ) -> Refusal | None:
        """One call of ``method`` by ``identity``: None (admitted: :meth:`done` when it
        ends, if ``max_in_flight``), or why not."""
        key = (method, identity)
        if max_in_flight and self.in_flight.get(key, 0) >= max_in_flight:
            return Refusal(TOO_MANY_IN_FLIGHT, "too_many_in_flight", IN_FLIGHT_RETRY_MS, max_in_flight)
        if rate:
            capacity = float(burst or max(1, math.ceil(rate)))
            now = self.clock()
            tokens, then, _, _ = self.buckets.get(key, (capacity, now, rate, capacity))
            tokens = min(capacity, tokens + (now - then) * rate)
            if tokens < 1:
                self.buckets[key] = (tokens, now, rate, capacity)
                return Refusal(RATE_LIMITED, "rate_limited", math.ceil((1 - tokens) / rate * 1000), capacity)
            self.buckets[key] = (tokens - 1, now, rate, capacity)
            if len(self.buckets) > SWEEP_OVER:
                self._sweep(now)
        if max_in_flight:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
        return None

    def done(self, method: str, identity: Hashable) -> None:
        """A call admitted with ``max_in_flight`` ended (answered, failed or abandoned)."""
        key = (method, identity)
        left = self.in_flight.get(key, 1) - 1
        if left > 0:
            self.in_flight[key] = left
        else:
            self.in_flight.pop(key, None)

    def _sweep(self, now: float) -> None:
        """Forget the buckets that have refilled, each at its own method's rate (a
        forgotten bucket starts full)."""
        for key, (tokens, then, rate, capacity) in list(self.buckets.items()):
            if tokens + (now - then) * rate >= capacity:
                del self.buckets[key]
