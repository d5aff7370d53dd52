"""The hub's door: handshakes and connections per identity, and the admission of each
request — the caps of this process, then the identity's bucket (the cluster's, shared by
a user's processes, on a backplane that keeps one) — with the refusal budgets that close
a connection ignoring its refusals (docs/admission.md)."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from realtime_app.conf.runtime import runtime, settings
from realtime_app.conf.typed import Settings
from realtime_app.hub.once import KEY_PARAM, Once
from realtime_app.inbound.admission import Admission, AdmissionLimits, Refusal, RefusalBudget
from realtime_app.inbound.method_limits import MethodLimits
from realtime_app.inbound.workers import Call, Coalesce, RequestPool, Run

if TYPE_CHECKING:
    from realtime_app.cluster.roles import LeasesAndOnce
    from realtime_app.observability.schema import AdmissionProbe

__all__ = ["Admitted", "Gate", "Gates", "Limited", "admission_limits", "handshake_limits"]

logger = logging.getLogger("realtime_app.hub")

#: Identities whose refusal budgets are remembered (the least recently refused forgotten first).
MAX_REFUSAL_BUDGETS = 10_000
#: Identities whose refused handshakes are remembered, to log each once while it lasts.
MAX_REFUSING = 10_000
Identity = tuple[str, str]


def admission_limits(s: Settings) -> AdmissionLimits:
    """The admission limits of ``REALTIME_APP`` (checked by ``realtime_app.E006``)."""
    return AdmissionLimits(
        max_pending=s.admission_max_pending,
        max_per_identity=s.admission_max_per_identity,
        bucket_capacity=float(s.admission_bucket_capacity),
        refill_per_s=float(s.admission_refill_per_s),
    )


def anonymous_handshake_limits(s: Settings) -> AdmissionLimits:
    """The process's bucket of anonymous handshakes (``MAX_ANONYMOUS_HANDSHAKES_PER_S``,
    bursts of twice that, one at least)."""
    rate = float(s.max_anonymous_handshakes_per_s)
    return AdmissionLimits(
        max_pending=0, max_per_identity=0, bucket_capacity=max(1.0, 2 * rate) if rate else 0.0, refill_per_s=rate
    )


def handshake_limits(s: Settings) -> AdmissionLimits:
    """The handshake bucket of each identity (``HANDSHAKES_PER_S``, ``HANDSHAKE_BURST``)."""
    rate = float(s.handshakes_per_s)
    return AdmissionLimits(
        max_pending=0,
        max_per_identity=0,
        bucket_capacity=float(s.handshake_burst) if rate else 0.0,
        refill_per_s=rate,
    )


class Gates(weakref.WeakSet["Gate"]):
    """Every gate of this process (one per hub), a part of its runtime: what a change of
    ``REALTIME_APP`` reaches at once (the reload rule, :mod:`realtime_app.conf.runtime`)."""

    def settings_changed(self) -> None:
        for gate in list(self):
            gate.configure(settings())


class Limited(Protocol):
    """What admission reads of an application method (``endpoint.methods.Method``)."""

    @property
    def coalesce(self) -> Coalesce | None: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def rate(self) -> float: ...
    @property
    def burst(self) -> int: ...
    @property
    def is_async(self) -> bool: ...
    @property
    def idempotent(self) -> bool: ...


@dataclass(slots=True)
class Admitted:
    """A request let in: what its run holds (a global slot unless it merged, a place in
    its method's books when it has limits) until it ends."""

    identity: Identity
    name: str
    method: Limited | None  # None: a built-in, run inline by its connection
    merged: bool = False
    key: Hashable | None = None
    units: float = 1.0


def coalescing(method: Limited, name: str, identity: Identity, params: Any) -> tuple[Hashable | None, float]:
    """A request's merge key and units; ``None`` (runs alone) when its params do not give
    them — the handler then answers what is wrong with them."""
    coalesce = method.coalesce
    if coalesce is None:
        return None, 1.0
    try:
        key = coalesce.key(identity, params)
        units = float(coalesce.units(params)) if key is not None else 1.0
    except Exception:
        return None, 1.0
    if key is None or not 0 < units <= coalesce.cap:
        return None, 1.0
    return (name, key), units


class Gate:
    """Who gets in, and which requests run: the counters of the probe's ``admission``."""

    def __init__(self, limits: Settings | None = None) -> None:
        self.settings = limits or settings()
        self.backplane: LeasesAndOnce | None = None  # set when the hub starts
        self.admission = Admission(admission_limits(self.settings))
        self.handshakes = Admission(handshake_limits(self.settings))  # its buckets only: handshakes per identity
        self.pool = RequestPool(self.admission, 0)
        self.methods = MethodLimits()  # per method and identity (rpc_method(max_in_flight=, rate=))
        self.identities: dict[Identity, int] = {}  # open connections per identity
        self.open = {"user": 0, "address": 0}  # open connections, signed-in and anonymous
        self.refused: dict[str, int] = {"connections": 0, "handshakes": 0, "server_full": 0, "process_handshakes": 0}
        self.draining = False  # the process stops: no new connection (realtime_app.endpoint.drain)
        # the anonymous handshakes of every address together: one bucket, drawn as one identity
        self._anonymous = Admission(anonymous_handshake_limits(self.settings))
        self.refusal_closes = 0  # connections closed (1008) for ignoring their refusals
        self.reconnect_tickets = 0  # handshakes let past the anonymous bucket by a drain's ticket
        self._refusing: set[Identity] = set()  # identities whose handshakes are refused now
        self._bucket_fallback: str | None = None  # why users' buckets are local now, if they are
        # Per identity, so that reconnecting does not refill it; least recently used first.
        self._refusal_budgets: OrderedDict[Identity, RefusalBudget] = OrderedDict()
        self.once = Once(self.settings, lambda: self.backplane)  # idempotent calls: rpc_method(idempotent=True)
        self.configure(self.settings)
        runtime().part(Gates).add(self)

    def configure(self, limits: Settings) -> None:
        """Take new limits (the reload rule, :mod:`realtime_app.conf.runtime`): the caps,
        buckets, pool size and connection ceilings apply from the next request on; what
        is admitted or open keeps its place, and each identity keeps its tokens."""
        try:
            books = admission_limits(limits), handshake_limits(limits), anonymous_handshake_limits(limits)
        except ValueError as exc:  # reported by the checks (E006): the limits in force stay
            logger.warning("new admission limits refused, the previous ones stay: %s (see manage.py check)", exc)
            return
        self.settings = self.once.settings = limits
        self.once.local.max_bytes = limits.idempotency_max_bytes
        self.admission.limits, self.handshakes.limits, self._anonymous.limits = books
        running = limits.admission_max_running
        self.pool.core.anonymous_share = max(1, int(running * (1 - float(limits.signed_in_reserve)))) if running else 0
        self.pool.max_running = running
        self._refusal_budgets.clear()  # sized by ADMISSION_CLOSE_AFTER_REFUSALS: started again

    def handshake(self, identity: Identity, anonymous: bool = True, ticket: Callable[[], bool] | None = None) -> bool:
        """Count one handshake of ``identity``; False past ``HANDSHAKES_PER_S`` (reconnect
        churn: every reconnect of an identity draws on the same bucket). ``anonymous``: an
        address's handshake also draws on the process's anonymous bucket (not a good
        token's: its user is known), unless ``ticket()`` says a drain handed it over
        (asked only then: a ticket is taken once, :mod:`realtime_app.endpoint.tickets`)."""
        self.handshakes.forget_idle()  # memory follows the identities that connect now
        if not self.handshakes.limits.bucket_capacity or self.handshakes.charge(identity, 1.0) is None:
            self._refusing.discard(identity)
            # its own bucket first: what one address may not open never draws on the others'
            if identity[0] == "user" or not anonymous:
                return True
            if ticket is not None and ticket():  # paced by the drain that told it
                self.reconnect_tickets += 1
                return True
            if not self._anonymous_handshake():
                self.refused["process_handshakes"] += 1
                return False
            return True
        self.refused["handshakes"] += 1
        if identity not in self._refusing:  # once until it slows down, not once per handshake
            if len(self._refusing) > MAX_REFUSING:
                self._refusing.clear()
            self._refusing.add(identity)
            logger.info(
                "refusing the handshakes of one %s: over %s per second (counted in the probe)",
                identity[0],
                self.handshakes.limits.refill_per_s,
            )
        return False

    def _anonymous_handshake(self) -> bool:
        """One anonymous handshake from the process's bucket: many addresses together
        cannot take every handshake."""
        return self._anonymous.charge("anonymous", 1.0) is None

    def enter(self, identity: Identity) -> str | None:
        """Count one open connection of ``identity``; why not, when it may not open one:
        ``"too many connections"`` (its own cap: 1008) or ``"server full"`` (the process's
        ceiling, or the share anonymous sockets may take of it: 1013)."""
        limits = self.settings
        kind = "user" if identity[0] == "user" else "address"
        ceiling = int(limits.max_connections)
        if ceiling:
            allowed = ceiling if kind == "user" else int(ceiling * (1 - float(limits.signed_in_reserve)))
            if self.open["user"] + self.open["address"] >= ceiling or (
                kind == "address" and self.open["address"] >= allowed
            ):
                self.refused["server_full"] += 1
                return "server full"
        cap = limits.max_connections_per_user if kind == "user" else limits.max_connections_per_address
        if cap and self.identities.get(identity, 0) >= cap:
            self.refused["connections"] += 1
            return "too many connections"
        self.identities[identity] = self.identities.get(identity, 0) + 1
        self.open[kind] += 1
        return None

    def leave(self, identity: Identity) -> None:
        left = self.identities.get(identity, 1) - 1
        if left > 0:
            self.identities[identity] = left
        else:
            self.identities.pop(identity, None)
        kind = "user" if identity[0] == "user" else "address"
        self.open[kind] = max(0, self.open[kind] - 1)

    async def admit_request(
        self, identity: Identity, name: str, method: Limited | None, cost: float, params: Any
    ) -> Admitted | Refusal:
        """The one door of every request: the method's own limits (no tokens spent on
        their refusal), then the process's caps and the identity's bucket. A request that
        merges into a waiting one of the same key holds no global slot of its own."""
        ticket = Admitted(identity, name, method)
        limited = bool(method and (method.max_in_flight or method.rate))
        if method is not None and method.coalesce is not None:
            ticket.key, ticket.units = coalescing(method, name, identity, params)
            ticket.merged = self.pool.would_merge(ticket.key, ticket.units, method.coalesce.cap)
        if method is not None and limited:
            refusal = self.methods.take(name, identity, method.max_in_flight, method.rate, method.burst)
            if refusal is not None:
                return refusal
        answer: Refusal | None | Any = ...  # until admit answers
        try:
            answer = await self.admit(identity, cost, merged=ticket.merged)
        finally:  # refused, or cancelled while the shared bucket answered: the method's place back
            if limited and answer is not None:
                self.methods.done(name, identity)
        return ticket if answer is None else answer

    def done(self, ticket: Admitted) -> None:
        """A built-in admitted by :meth:`admit_request` ended."""
        self.admission.release(ticket.identity)

    def submit(self, ticket: Admitted, owner: Hashable, params: Any, run: Run) -> asyncio.Future[Any]:
        """Queue an admitted application call in the pool; its future gives ``(ok, result
        or error)``. Every place it holds is given back however it ends."""
        method = ticket.method
        assert method is not None
        key = params.get(KEY_PARAM) if method.idempotent and isinstance(params, dict) else None
        if key is not None:  # runs once for its key: every repeat gets the first answer
            run = partial(self.once.run, ticket.identity, key, run)
        # A keyed call runs to its end even if its connection closes: its answer is kept for the retry.
        cancellable = method.is_async and key is None
        call = Call(owner, run, ticket.name, params, ticket.identity, ticket.merged, method.coalesce, cancellable)
        if method.max_in_flight or method.rate:
            name, identity, books = ticket.name, ticket.identity, self.methods
            call.future.add_done_callback(lambda _: books.done(name, identity))
        coalesce = method.coalesce
        self.pool.submit(
            call, ticket.key, ticket.units, coalesce.cap if coalesce else 0.0, bool(coalesce and coalesce.serial)
        )
        return call.future

    async def charge_error(self, identity: Identity) -> Refusal | None:
        """An invalid request takes ``ADMISSION_ERROR_COST`` tokens: None when it had them,
        else the refusal to answer instead of the error (a flood of bad input is refused,
        then closed, as other floods are)."""
        refusal = await self.admit(identity, float(self.settings.admission_error_cost))
        if refusal is None:
            self.admission.release(identity)
        return refusal

    async def admit(self, identity: Identity, cost: float, *, merged: bool = False) -> Refusal | None:
        """Admit one request: the caps here, then the bucket — the cluster's for a user on
        a backplane that shares them; else this process's, and the probe says why."""
        admission = self.admission
        refusal = admission.reserve(identity, merged=merged)
        if refusal is not None:
            return refusal
        limits = admission.limits
        try:
            if identity[0] == "user" and limits.bucket_capacity and self.backplane and self.backplane.clustered:
                refusal = await self._take_shared(identity, cost)
            else:
                refusal = admission.charge(identity, cost)
        except BaseException:  # cancelled while the shared bucket answered: give the slot back
            admission.cancel(identity, merged=merged)
            raise
        if refusal is not None:
            admission.cancel(identity, merged=merged)
        else:
            admission.confirm(merged=merged)
        return refusal

    async def _take_shared(self, identity: Identity, cost: float) -> Refusal | None:
        assert self.backplane is not None
        limits = self.admission.limits
        try:
            wait_ms = await self.backplane.take_tokens(
                f"{identity[0]}:{identity[1]}", cost, limits.bucket_capacity, limits.refill_per_s
            )
        except NotImplementedError:
            self._bucket_fallback = "the backplane shares no buckets"
            return self.admission.charge(identity, cost)
        except self.backplane.errors:  # the outage is logged by the beat
            self._bucket_fallback = "backplane unreachable"
            return self.admission.charge(identity, cost)
        self._bucket_fallback = None
        return None if wait_ms is None else self.admission.rate_limited(wait_ms)

    def spend_refusal(self, identity: Identity) -> bool:
        """Count one refusal of ``identity`` against ``ADMISSION_CLOSE_AFTER_REFUSALS``;
        False when its budget is spent: the caller closes the connection (1008), counted."""
        budgets = self._refusal_budgets
        budget = budgets.get(identity)
        if budget is None:
            budget = budgets[identity] = RefusalBudget(float(self.settings.admission_close_after_refusals))
            while len(budgets) > MAX_REFUSAL_BUDGETS:
                budgets.popitem(last=False)
        else:
            budgets.move_to_end(identity)
        if budget.spend(time.monotonic()):
            return True
        self.refusal_closes += 1
        return False

    @property
    def shared_bucket(self) -> str:
        """Where users' buckets live: ``"shared"`` (the cluster's), ``"local"`` (one
        process, no cluster), or ``"local (why)"`` while the backplane cannot share them."""
        if self.backplane is None or not self.backplane.clustered:
            return "local"
        return "shared" if self._bucket_fallback is None else f"local ({self._bucket_fallback})"

    def probe(self, unread_refused: int) -> AdmissionProbe:
        return {
            "pending": self.admission.pending,
            "queued": self.pool.waiting,
            "running": self.pool.running,
            "admitted": self.admission.admitted,
            "completed": self.pool.completed,
            "coalesced": self.pool.merges,
            "abandoned": self.pool.abandoned,
            "refused": {**self.admission.refused, "unread_responses": unread_refused},
            "identities": self.admission.identities,
            "bucket": self.shared_bucket,
            "closed_for_refusals": self.refusal_closes,
            "reconnect_tickets": self.reconnect_tickets,
            **{f"once_{name}": n for name, n in self.once.probe().items()},  # type: ignore[typeddict-item]
        }
