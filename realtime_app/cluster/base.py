"""How processes share publications, ticker leases, sequences and probes: the interface.

:class:`Backplane` is the contract — the five roles of :mod:`realtime_app.cluster.roles`
in one object — and only the contract; the implementations live in their own modules:

* :mod:`realtime_app.cluster.memory` — the embedded default, one process;
* :mod:`realtime_app.cluster.redis` — a cluster on channels-redis;
* :mod:`realtime_app.cluster.postgres` — a cluster on PostgreSQL alone.

``REALTIME_APP["BACKPLANE"]`` chooses one: ``"auto"`` (Redis when the default channel
layer is channels-redis), ``"memory"``, ``"redis"``, ``"postgres"``, or the dotted path of
a subclass.

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
from typing import Any

from realtime_app.cluster.roles import (
    Broker,
    Deliver,
    Delivery,
    HistoryStore,
    LeaseStore,
    OnceStore,
    PresenceStore,
    now_ms,
)
from realtime_app.observability.logsafe import Outage
from realtime_app.observability.schema import ShardProbe
from realtime_app.wire.history import HistoryPolicy

__all__ = ["PRESENCE_KEEP_MS", "Backplane", "Delivery", "Deliver", "Lineages", "delivery", "now_ms"]

logger = logging.getLogger("realtime_app.backplane")


#: How long a presence part of a process marked alive is kept between its writes: its
#: process renews it a third of this after each write (an idle room costs a write every
#: 20 minutes, not every beat); a process that dies takes its parts with it as soon as its
#: alive mark lapses (a lease).
PRESENCE_KEEP_MS = 3_600_000


class Backplane(Broker, HistoryStore, PresenceStore, LeaseStore, OnceStore):
    """Every role in one object (:mod:`realtime_app.cluster.roles`), as the memory and
    Redis backplanes are: subclass and implement each role's methods."""

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

    def shards_probe(self) -> list[ShardProbe]:
        """Each server the backplane uses, up or down (none for one process in memory)."""
        return []

    def _cluster_settings(self, config: dict[str, Any] | None) -> dict[str, Any]:
        """The settings every shared backplane keeps (prefix, lease, count and re-assert
        lives), read once; the whole merged settings returned for the rest."""
        from realtime_app.conf import with_defaults

        settings = with_defaults(config)
        self.prefix: str = settings["KEY_PREFIX"]
        self.lease_ttl_ms: int = settings["LEASE_TTL_MS"]
        self.seq_ttl_ms: int = settings["SEQ_IDLE_TTL_MS"]
        self.reassert_ms: int = settings["REASSERT_INTERVAL_MS"]
        return settings

    async def publish_once(
        self, channel: str, data_json: str, floor: int, history: HistoryPolicy, key: str, window_ms: int
    ) -> int | None:
        """Without a shared book: published (at least once)."""
        return await self.publish(channel, data_json, floor, history)

    async def presence_alive(self, ttl_ms: int) -> tuple[int, bool] | None:
        """None: a process cannot be marked here (each part lives ``ttl_ms``, written every beat)."""
        return None


class Lineages:
    """The rules of a channel with history that every store keeping one shares: how long
    its count and epoch live, and the probe's count of what it keeps."""

    seq_ttl_ms: int
    histories: dict[str, tuple[str, int]]

    def _keep_ms(self, history: HistoryPolicy) -> int:
        """How long a channel's count and epoch live (its lineage outlives its history)."""
        from realtime_app.cluster.redis_scripts import KEEP_LINEAGE_MS

        return max(self.seq_ttl_ms, history.ttl_ms, KEEP_LINEAGE_MS)

    def _counted(self, channel: str, seq: Any, epoch: Any, history: HistoryPolicy) -> int:
        """A kept publication's seq; the history's size counted (exactly again at each read)."""
        epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch)
        seen, kept = self.histories.get(channel, ("", 0))
        self.histories[channel] = (epoch, min(history.size, kept + 1) if seen == epoch else 1)
        return int(seq)


def delivery(channel: str, data: bytes) -> Delivery:
    """A message of a channel's pub/sub or ``NOTIFY`` channel as a :class:`Delivery`:
    ``f <seq> <epoch or -> <notification text>`` (a frame; see
    :data:`.redis_scripts.PUBLISH`) or ``r 0 - <instance>`` (that process released the
    channel's lease)."""
    kind, seq, epoch, rest = data.split(b" ", 3)
    if kind == b"f":
        return Delivery("frame", channel, rest.decode(), int(seq), "" if epoch == b"-" else epoch.decode())
    if kind == b"r":
        return Delivery("released", channel, rest.decode())
    raise ValueError(f"unknown backplane message kind {kind!r}")
