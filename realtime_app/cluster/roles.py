"""The backplane by role: small interfaces, each what one part of the hub needs of the
rest of the cluster, so that a store implements only what it stores.

* :class:`Broker` — publications: numbered, delivered to every process that joined;
* :class:`HistoryStore` — what channels with history keep (``{seq, epoch}`` resume);
* :class:`PresenceStore` — each process's part of each presence channel;
* :class:`LeaseStore` — leases (one ticker per channel), probes and shared buckets;
* :class:`OnceStore` — idempotent calls' claims and answers.

Every role shares :class:`Reachable`: whether processes share it (``clustered``), which
exceptions mean "unreachable now" (``errors``) and the outage it logs. The hub's rooms
type what they are given as the role they use (``hub.replay`` a :class:`HistoryStore`,
``hub.presence`` a :class:`PresenceStore`, ...): the import contracts in
``pyproject.toml`` keep them off the implementations. :class:`~realtime_app.cluster.base.Backplane`
is all five in one object, as the memory and Redis backplanes are today; a backplane named
by ``BACKPLANE`` plays all five (:func:`missing_methods` says what one lacks: check E003,
and a hub refuses to start on it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from realtime_app.observability.logsafe import Outage
from realtime_app.observability.schema import ProcessProbe, ShardProbe
from realtime_app.wire.history import PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since

__all__ = [
    "Broker",
    "BrokerAndLeases",
    "DurableBroker",
    "Deliver",
    "Delivery",
    "HistoryStore",
    "LeaseStore",
    "LeasesAndOnce",
    "OnceStore",
    "PresenceStore",
    "ROLES",
    "Reachable",
    "SHARED_BOOKS",
    "missing_methods",
    "now_ms",
]


@dataclass(frozen=True, slots=True)
class Delivery:
    """Something the backplane brings to this process."""

    kind: Literal["frame", "released"]
    channel: str
    text: str = ""  # the encoded ``message`` notification (frames)
    seq: int = 0  # its ``seq`` (frames)
    epoch: str = ""  # its history's epoch (frames of a channel with history)


Deliver = Callable[[Delivery], Awaitable[None]]


def now_ms() -> int:
    return int(time.time() * 1000)


class Reachable(Protocol):
    """What every role says of itself."""

    #: True when several processes may share it (leases and groups matter).
    clustered: bool
    #: Exceptions that mean "unreachable now, try again later" (anything else is a bug).
    errors: tuple[type[BaseException], ...]
    #: Up/down as logged: one line when it goes, one when it comes back.
    outage: Outage
    instance_id: str

    def shards_probe(self) -> list[ShardProbe]:
        """Each server the backplane uses, up or down (none for one process in memory)."""
        return []


class Broker(Reachable, Protocol):
    """Publications: numbered, delivered to every process that joined their channel."""

    async def start(self, deliver: Deliver) -> None:
        """Begin receiving for this process: hand every :class:`Delivery` to ``deliver``."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop receiving and close connections (leases expire on their own)."""
        raise NotImplementedError

    async def check(self) -> bool:
        """False when the backplane lost what it kept for this process since the last
        check (restart, flush, expiry): the hub then re-asserts its state."""
        raise NotImplementedError

    async def join(self, channels: list[str]) -> None:
        """Make this process a member of each channel's group (idempotent: also a refresh)."""
        raise NotImplementedError

    async def leave(self, channel: str) -> None:
        """This process's last local subscriber of ``channel`` has left."""
        raise NotImplementedError

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        """Number one publication (already encoded data) and deliver it; returns its ``seq``.

        ``seq`` is one more than the channel's previous one and always above ``floor``
        (the highest ``seq`` this process has seen), even if the backplane lost its count.
        With ``history``, the publication is kept too, atomically with its numbering (the
        history's order is ``seq`` order), and its notification carries the epoch.
        """
        raise NotImplementedError

    async def reseed(self, floors: dict[str, int]) -> None:
        """Raise each channel's count to at least its floor (after a loss of state)."""
        raise NotImplementedError


class HistoryStore(Reachable, Protocol):
    """What channels with history keep, read back by epoch and ``seq``."""

    #: Per channel with history: (epoch, publications kept) as last seen here, for the probe.
    histories: dict[str, tuple[str, int]]

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        """The channel's epoch and last ``seq`` (raised to ``floor``) and, with ``since``,
        the first page of kept publications after it. A new epoch begins when the channel
        has none or its history was lost."""
        raise NotImplementedError

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        """Up to ``count`` kept publications after ``seq`` ``after`` (the next page), no
        more than ``max_bytes`` of text but at least one."""
        raise NotImplementedError


class PresenceStore(Reachable, Protocol):
    """Each process's part of each presence channel, kept as long as the process lives."""

    async def put_presence(self, parts: dict[str, str | None], ttl_ms: int, alive: bool = False) -> None:
        """This process's part of each channel's presence (:mod:`realtime_app.wire.presence`),
        kept ``ttl_ms`` unless written again (a process that dies takes its members with
        it); None: it has none there any more. The same part written again only renews it:
        readers see no change. ``alive``: the parts of a process that marks itself alive
        (:meth:`presence_alive`), gone as soon as its mark lapses."""
        raise NotImplementedError

    async def presence_alive(self, ttl_ms: int) -> tuple[int, bool] | None:
        """Mark this process alive for ``ttl_ms`` (each beat): ``(how long its parts are
        kept between writes, whether its mark was still there)``; None where a process
        cannot be marked (each part then lives ``ttl_ms`` and is written every beat)."""
        return None

    async def read_presence(self, known: dict[str, str]) -> dict[str, tuple[str, list[str]] | None]:
        """Each channel's version and the parts of live processes, or None when its version
        is still ``known[channel]`` (nothing to read again)."""
        raise NotImplementedError


class LeaseStore(Reachable, Protocol):
    """Leases (one ticker per channel in the cluster), the processes' probes and the
    buckets they share: what keeps the cluster one."""

    async def acquire(self, channel: str) -> bool:
        """Try to become the process that runs ``channel``'s ticker."""
        raise NotImplementedError

    async def renew(self, channel: str) -> bool:
        """Keep the lease (or take it again if it vanished); False: another process has it."""
        raise NotImplementedError

    async def release(self, channel: str) -> None:
        """Give the lease up and tell the other subscribed processes."""
        raise NotImplementedError

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        """Publish this process's probe for ``ttl_ms``."""
        raise NotImplementedError

    async def drop_probe(self) -> None:
        """Withdraw this process's probe (clean shutdown)."""
        raise NotImplementedError

    async def cluster_probes(self) -> list[ProcessProbe]:
        """The probes of every live process."""
        raise NotImplementedError

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        """Take ``cost`` tokens of a bucket shared by the cluster, atomically: ``None`` when
        taken, else the milliseconds until they will be there. A backplane that shares no
        state between processes raises ``NotImplementedError`` (each process keeps its own)."""
        raise NotImplementedError


class OnceStore(Reachable, Protocol):
    """Idempotent calls' claims and answers, shared by the processes."""

    async def claim_once(self, name: str, owner: str, ttl_ms: int) -> tuple[Any, str | None]:
        """Claim an idempotency key for ``owner`` (``("run", None)``), or say it is
        ``("running", None)`` or answered (``("answer", text)``): :mod:`realtime_app.hub.once`.
        A backplane that shares no state raises ``NotImplementedError`` (each process
        keeps its own book)."""
        raise NotImplementedError

    async def keep_once(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        """Keep the answer of ``owner``'s claim for ``ttl_ms``."""
        raise NotImplementedError

    async def renew_once(self, name: str, owner: str, ttl_ms: int) -> None:
        """Extend ``owner``'s claim: its call still runs."""
        raise NotImplementedError

    async def publish_once(
        self, channel: str, data_json: str, floor: int, history: HistoryPolicy, key: str, window_ms: int
    ) -> int | None:
        """Publish a durable channel's outbox row unless a publication with ``key`` was made
        within ``window_ms``: its ``seq``, or None when it had been published (a drain
        repeated after a crash). Without a shared book: published (at least once)."""
        raise NotImplementedError


class BrokerAndLeases(Broker, LeaseStore, Protocol):
    """What carrying out membership and leases needs (``hub.convergence``)."""


class LeasesAndOnce(LeaseStore, OnceStore, Protocol):
    """What the gate shares with the cluster: the buckets and the idempotent answers."""


class DurableBroker(Broker, LeaseStore, OnceStore, Protocol):
    """What the outbox's drain needs: a lease to drain alone, publications once."""


#: The five roles a backplane named by ``BACKPLANE`` plays.
ROLES: tuple[type, ...] = (Broker, HistoryStore, PresenceStore, LeaseStore, OnceStore)
#: What a backplane may leave to the roles (their ``NotImplementedError`` is the documented
#: fallback): each process then keeps its own buckets and idempotency book.
SHARED_BOOKS = frozenset({"take_tokens", "claim_once", "keep_once", "renew_once"})


def missing_methods(cls: type) -> list[str]:
    """The role methods ``cls`` leaves to the roles' stubs, which raise
    ``NotImplementedError`` at their first call (``"LeaseStore.acquire"``, ...): what a
    backplane must still implement before a hub can run on it."""
    missing = []
    for role in ROLES:
        for name, stub in vars(role).items():
            if name.startswith("_") or not callable(stub) or getattr(cls, name, None) is not stub:
                continue
            if name in SHARED_BOOKS:  # raising NotImplementedError there is the documented fallback
                continue
            missing.append(f"{role.__name__}.{name}")
    return missing
