"""When a client comes back after a refusal: one rule for the Python client, the browser
module (``retryDelayMs``, shared vectors: tests/vectors/refusal.json) and the tests. Pure."""

from __future__ import annotations

import math

__all__ = ["RENEWAL_RETRY_REASONS", "retry_delay_ms"]

#: Refusals of a subscription renewed after a reconnect that pass with time (a crowd of
#: resumes after a deploy, a bucket, a busy backplane): the client sends the renewal again
#: after ``retry_after_ms``. The others (too many tickers, instances, connections) are the
#: application's to handle: reported once. The browser module's ``RENEWAL_RETRY_REASONS``
#: is the same list (tests/vectors/constants.json).
RENEWAL_RETRY_REASONS = frozenset(
    {"backplane_unavailable", "overloaded", "rate_limited", "too_many_in_flight", "too_many_resumes"}
)


def retry_delay_ms(retry_after_ms: float, u: float) -> int:
    """How long a client waits before retrying a refused request: ``retry_after_ms`` plus
    up to a quarter more (``u`` uniform in [0, 1)), so that refused clients do not all come
    back at once — never earlier than the server said. The browser module's
    ``retryDelayMs`` is the same rule (shared vectors: tests/vectors/refusal.json)."""
    return math.ceil(retry_after_ms * (1 + 0.25 * u))
