"""How processes share publications, ticker leases, sequences and probes: the interface.

:class:`Backplane` is the contract, and only the contract; the implementations live in
their own modules:

* :mod:`realtime_app.cluster.memory` — the embedded default, one process;
* :mod:`realtime_app.cluster.redis` — a cluster on channels-redis.

``REALTIME_APP["BACKPLANE"]`` chooses one: ``"auto"`` (Redis when the default channel
layer is channels-redis), ``"memory"``, ``"redis"``, or the dotted path of a subclass.

The hub hands ``start()`` a ``deliver`` callback and never looks inside: what arrives for
this process (a frame of a channel it joined, another process giving a lease up) comes
back through it. Every method may raise when the backplane is unreachable; the hub
treats that as an outage, keeps its desired state and re-asserts it once the backplane
answers again (see :mod:`realtime_app.hub.reconciler`). State a backplane keeps for a
process (group membership, leases, sequence numbers) may vanish at any time (a restart,
an expiry): :meth:`check` reports it, and the hub joins and reseeds again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from realtime_app.observability.logsafe import Outage
from realtime_app.observability.schema import ProcessProbe, ShardProbe
from realtime_app.wire.history import PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since

__all__ = ["PRESENCE_KEEP_MS", "Backplane", "Delivery", "Deliver", "now_ms"]


@dataclass(frozen=True, slots=True)
class Delivery:
    """Something the backplane brings to this process."""

    kind: Literal["frame", "released"]
    channel: str
    text: str = ""  # the encoded ``message`` notification (frames)
    seq: int = 0  # its ``seq`` (frames)
    epoch: str = ""  # its history's epoch (frames of a channel with history)


Deliver = Callable[[Delivery], Awaitable[None]]


logger = logging.getLogger("realtime_app.backplane")


def now_ms() -> int:
    return int(time.time() * 1000)


#: How long a presence part of a process marked alive is kept between its writes: its
#: process renews it a third of this after each write (an idle room costs a write every
#: 20 minutes, not every beat); a process that dies takes its parts with it as soon as its
#: alive mark lapses (a lease).
PRESENCE_KEEP_MS = 3_600_000


class Backplane:
    """What the hub needs from the rest of the cluster. Subclass and implement every method."""

    #: True when several processes may share channels (leases and groups matter).
    clustered = False
    #: Exceptions that mean "unreachable now, try again later" (anything else is a bug).
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)

    def __init__(self, *, instance_id: str = "headless", config: dict[str, Any] | None = None) -> None:
        self.instance_id = instance_id
        self.config = config or {}
        #: Up/down as logged: one line when it goes, one when it comes back.
        self.outage = Outage(logger, f"backplane {type(self).__name__}")
        #: Per channel with history: (epoch, publications kept) as last seen here, for the probe.
        self.histories: dict[str, tuple[str, int]] = {}

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

    async def reseed(self, floors: dict[str, int]) -> None:
        """Raise each channel's count to at least its floor (after a loss of state)."""
        raise NotImplementedError

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

    def shards_probe(self) -> list[ShardProbe]:
        """Each server the backplane uses, up or down (none for one process in memory)."""
        return []

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        """Take ``cost`` tokens of a bucket shared by the cluster, atomically: ``None`` when
        taken, else the milliseconds until they will be there. A backplane that shares no
        state between processes raises ``NotImplementedError`` (each process keeps its own)."""
        raise NotImplementedError

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
        return await self.publish(channel, data_json, floor, history)

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
