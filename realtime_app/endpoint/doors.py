"""HTTP doors answered before Django's middleware (by :class:`~realtime_app.routing.MetricsShortcut`,
which wraps the project's HTTP application): the publish API's key, and readiness.

A keyless flood of the publish API went through every middleware of the project to be
told 401 by the view: 151 requests a second kept daphne at 96 % of a core and a real
publisher waited 46 times longer. Here a request without a valid key costs a header
comparison, and an address that keeps failing is answered 429 without even that. A
``/realtime/ready`` 503 answered by Django is an ERROR line of ``django.request`` (every
5xx is) — one a second per draining process under a load balancer's poll; answered here
it is what it is, a state, logged once when it changes.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from realtime_app.conf.runtime import settings
from realtime_app.endpoint.addresses import client_address, client_network, trusted_networks
from realtime_app.inbound.admission import Admission, AdmissionLimits
from realtime_app.wire.asgi import Scope

__all__ = ["FAILURE_BURST", "FAILURE_REFILL_PER_S", "Answer", "PublishDoor", "client_identity", "readiness"]

logger = logging.getLogger("realtime_app.http")

#: Requests with a wrong key or none one address may send at once, and per second after:
#: past them it is answered 429 with Retry-After, its key not even compared.
FAILURE_BURST = 20.0
FAILURE_REFILL_PER_S = 1.0
#: Addresses remembered as refused (logged once while refused), at most.
MAX_REFUSING = 10_000

Answer = tuple[int, dict[str, Any], list[tuple[bytes, bytes]]]  # status, JSON body, extra headers


def client_identity(scope: Scope) -> tuple[str, str]:
    """The client's network (its address read through ``TRUSTED_PROXIES``), as for its
    sockets and the HTTP pools."""
    config = settings()
    address = client_address(scope, trusted_networks(tuple(config.trusted_proxies)), config.forwarded_header)
    return ("address", client_network(address, config.address_prefix_v4, config.address_prefix_v6))


def valid_key(header: bytes) -> bool:
    """``Authorization: Bearer <a key of PUBLISH_API_KEYS>`` (compared in constant time)."""
    keys = settings().publish_api_keys
    return any(hmac.compare_digest(header, f"Bearer {key}".encode()) for key in keys)


class PublishDoor:
    """The publish API's key, checked before Django: None lets a request with a valid key
    through to the view; anything else is answered here — 401 (a failure, drawn from
    the address's bucket) or 429 (the bucket is empty). A valid key always passes: a
    flood from the same address (a proxy not in ``TRUSTED_PROXIES``) never locks the real
    publisher out."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        limits = AdmissionLimits(
            max_pending=0, max_per_identity=0, bucket_capacity=FAILURE_BURST, refill_per_s=FAILURE_REFILL_PER_S
        )
        self.failures = Admission(limits, clock)
        self.refused = {"key": 0, "throttled": 0}
        self._refusing: set[Hashable] = set()

    def answer(self, scope: Scope) -> Answer | None:
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if valid_key(header):  # a real publisher is never throttled for others' failures
            return None
        identity = client_identity(scope)
        self.failures.forget_idle()
        if self.failures.tokens(identity) < 1:
            self.refused["throttled"] += 1
            refusal = self.failures.charge(identity, 1.0)
            retry_ms = refusal.retry_after_ms if refusal is not None else 1000
            self._log_once(identity)
            seconds = str(max(1, -(-retry_ms // 1000))).encode()
            return (
                429,
                {"error": "too many requests without a valid key", "retry_after_ms": retry_ms},
                [(b"retry-after", seconds)],
            )
        self._refusing.discard(identity)
        self.refused["key"] += 1
        self.failures.charge(identity, 1.0)
        return (
            401,
            {"error": "a key of PUBLISH_API_KEYS is required"},
            [(b"www-authenticate", b'Bearer realm="realtime publish"')],
        )

    def _log_once(self, identity: Hashable) -> None:
        if identity in self._refusing:
            return
        if len(self._refusing) >= MAX_REFUSING:
            self._refusing.clear()
        self._refusing.add(identity)
        logger.info("publish API: refusing one address's requests for a while (too many without a valid key)")


def readiness() -> Answer:
    """``/realtime/ready``: 200 while this process takes connections; 503 once it drains
    (SIGTERM) or while a write-behind store's journal cannot be written (acknowledged
    changes would be lost at the next stop). No auth, no Redis, no database."""
    from realtime_app.hub.hubs import hub_of_current_loop, running_hub
    from realtime_app.persistence.lifecycle import journal_problem

    hub = hub_of_current_loop() or running_hub()
    if hub is not None and hub.gate.draining:
        return 503, {"ready": False, "draining": True}, []
    problem = journal_problem()
    if problem is not None:
        return 503, {"ready": False, "reason": "journal", "why": problem}, []
    return 200, {"ready": True}, []


def encode_answer(answer: Answer) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """An answer as ASGI's ``http.response.start`` headers and body."""
    status, body, extra = answer
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    return status, headers, data
