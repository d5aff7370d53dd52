"""Limits of one method for one identity, beside the identity's own (docs/admission.md):
calls of that method in flight (``rpc_method(max_in_flight=)``) and calls a second
(``rpc_method(rate=, burst=)``). Each limited method keeps books of its own — an
:class:`~realtime_app.inbound.admission.Admission` with the method's cap and bucket — so the
refusals, their ``retry_after_ms`` and the forgetting of idle identities are the
identity's own rules, applied per method.

An expensive method (an export, a search) is limited on its own, without lowering the
identity's whole budget: past its limit a call is refused -32004 ``too_many_in_flight``
or -32005 ``rate_limited``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

from realtime_app.inbound.admission import Admission, AdmissionLimits, Refusal

__all__ = ["MethodLimits"]


class MethodLimits:
    """The books of every method that has limits of its own, by method name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.books: dict[str, Admission] = {}

    def take(
        self, method: str, identity: Hashable, max_in_flight: int = 0, rate: float = 0.0, burst: int = 0
    ) -> Refusal | None:
        """One call of ``method`` by ``identity``: None (admitted: :meth:`done` when it
        ends), or why not."""
        book = self.books.get(method)
        if book is None:
            capacity = float(burst or max(1, math.ceil(rate))) if rate else 0.0
            limits = AdmissionLimits(
                max_pending=0,
                max_per_identity=max_in_flight,
                bucket_capacity=capacity,
                refill_per_s=rate,
                idle_s=max(60.0, capacity / rate if rate else 0.0),  # forgotten once full again
            )
            book = self.books[method] = Admission(limits, self.clock)
        return book.admit(identity, 1.0)

    def done(self, method: str, identity: Hashable) -> None:
        """A call admitted by :meth:`take` ended (answered, failed or abandoned)."""
        book = self.books.get(method)
        if book is not None:
            book.release(identity)

    @property
    def in_flight(self) -> dict[tuple[str, Hashable], int]:
        """Calls in flight, by (method, identity): what the probe and tests read."""
        return {
            (method, identity): n
            for method, book in self.books.items()
            for identity, n in book.pending_by_identity().items()
        }
