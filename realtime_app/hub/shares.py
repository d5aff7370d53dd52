"""Each identity's share of what subscribers make a process run: tickers (each holds a
lease and runs a factory) and live instances of templates (each with its presence
state). The process's bounds (``MAX_TICKERS``, ``MAX_INSTANCES``...) alone are a pool
the first comer takes whole: one address with ten idle sockets held every ticker. Here
an identity — a user, or an anonymous client's network, as for its connections — holds
at most ``MAX_TICKERS_PER_IDENTITY`` tickers and ``MAX_INSTANCES_PER_IDENTITY``
instances, counted while one of its subscriptions keeps each of them, whoever opened it.

:class:`ShareBook` is the pure count; the hub asks it in the same step as it adds the
subscription (no await between), so the bound is exact.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from realtime_app.conf.runtime import settings
from realtime_app.exceptions import RPCError
from realtime_app.hub.budgets import ExpiringBytes
from realtime_app.inbound.admission import retry_after_ms
from realtime_app.wire.protocol import OVERLOADED

if TYPE_CHECKING:
    from realtime_app.declarations.registry import ChannelSpec

__all__ = ["SHARE_RETRY_MS", "ShareBook", "lineage_bytes", "share_full", "share_keys"]

#: When a subscribe refused for its identity's share may come back (it frees a place by
#: unsubscribing; nothing frees it sooner).
SHARE_RETRY_MS = 5000

Identity = tuple[str, str]
Key = tuple[str, ...]  # ("ticker", channel) or ("instance", template, base)


def lineage_bytes(channel: str) -> int:
    """What a channel's count and epoch cost on Redis, about: two keys named after it, an
    epoch and a run id, and Redis's own overhead per key (328 B measured for a
    40-character name)."""
    return 2 * (len(channel) + 124)


def share_keys(spec: ChannelSpec) -> list[Key]:
    """What a subscription to ``spec`` holds: its ticker, its template's instance."""
    keys: list[Key] = []
    if spec.has_ticker:
        keys.append(("ticker", spec.name))
    if spec.declared is not None:
        keys.append(("instance", spec.declared.pattern, spec.base))
    return keys


class ShareBook:
    """Per identity, which tickers and instances its subscriptions hold (each counted
    once however many of its connections and cadences hold it)."""

    def __init__(self, refused: dict[str, int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.refused = refused if refused is not None else {}  # the probe's, by limit
        self.clock = clock
        #: Backplane state subscribes made live, soonest to expire first: (expiry, n, identity, bytes).
        self.stored = ExpiringBytes()  # backplane state subscribes made live, per identity
        self.entries: dict[tuple[Hashable, str], tuple[Identity, list[Key]]] = {}  # (holder, channel) ->
        self.refs: dict[Identity, Counter[Key]] = {}
        self.held: dict[Identity, Counter[str]] = {}  # identity -> "ticker"/"instance" -> distinct keys

    def refusal(self, identity: Identity, spec: ChannelSpec, tickers: int, instances: int) -> tuple[str, int] | None:
        """``(reason, limit)`` when a subscription of ``identity`` to ``spec`` would take
        one ticker or instance past its share (``0``: no share); None when it fits."""
        refs = self.refs.get(identity, Counter())
        held = self.held.get(identity, Counter())
        for key in share_keys(spec):
            limit = tickers if key[0] == "ticker" else instances
            if limit and key not in refs and held[key[0]] >= limit:
                return ("too_many_tickers" if key[0] == "ticker" else "too_many_instances", limit)
        return None

    def take(self, holder: Hashable, identity: Identity | None, spec: ChannelSpec) -> None:
        """``holder`` (a connection) subscribes to ``spec`` for ``identity``: counted, or
        an -32003 refusal naming the full share (``bound: "identity"``). No identity (a
        connection the hub did not count in): no share."""
        entry = (holder, spec.name)
        keys = share_keys(spec)
        if identity is None or not keys or entry in self.entries:
            return
        config = settings()
        refused = self.refusal(identity, spec, config.max_tickers_per_identity, config.max_instances_per_identity)
        stored = config.max_backplane_bytes_per_identity
        if refused is None and spec.history is not None and stored and self.bytes_of(identity) >= stored:
            if not any(key in self.refs.get(identity, ()) for key in keys):  # one it holds costs nothing new
                self.refused["backplane_bytes"] = self.refused.get("backplane_bytes", 0) + 1
                raise share_full("too_many_instances", stored, "backplane_bytes", self._retry_ms(identity))
        if refused is not None:
            limit = "ticker_shares" if refused[0] == "too_many_tickers" else "instance_shares"
            self.refused[limit] = self.refused.get(limit, 0) + 1
            raise share_full(*refused)
        self.entries[entry] = (identity, keys)
        refs = self.refs.setdefault(identity, Counter())
        held = self.held.setdefault(identity, Counter())
        for key in keys:
            if not refs[key]:
                held[key[0]] += 1
            refs[key] += 1

    def give(self, holder: Hashable, channel: str) -> None:
        """``holder``'s subscription to ``channel`` ended (on every path: the hub's one
        place where a local subscription is dropped)."""
        taken = self.entries.pop((holder, channel), None)
        if taken is None:
            return
        identity, keys = taken
        refs, held = self.refs[identity], self.held[identity]
        for key in keys:
            refs[key] -= 1
            if not refs[key]:
                del refs[key]
                held[key[0]] -= 1
                if not held[key[0]]:
                    del held[key[0]]
        if not refs:
            del self.refs[identity], self.held[identity]

    def stored_by(self, identity: Identity, nbytes: int, ttl_ms: int) -> None:
        """``identity``'s subscribe made ``nbytes`` of backplane state live for ``ttl_ms``
        (a fresh channel's lineage: :attr:`HistoryRead.created`)."""
        self.stored.add(identity, nbytes, self.clock() + ttl_ms / 1000)

    @property
    def stored_bytes(self) -> dict[Hashable, int]:
        return self.stored.bytes

    def bytes_of(self, identity: Identity) -> int:
        """The backplane state ``identity``'s subscribes keep live now (bytes, about)."""
        return self.stored.of(identity, self.clock())

    def total_bytes(self) -> int:
        """Every identity's (the probe's gauge)."""
        return self.stored.total(self.clock())

    def _retry_ms(self, identity: Identity) -> int:
        first = self.stored.first_expiry(identity)
        return max(1, retry_after_ms(first - self.clock())) if first is not None else SHARE_RETRY_MS

    def count(self, identity: Identity, kind: str) -> int:
        """How many tickers (``"ticker"``) or instances (``"instance"``) ``identity`` holds."""
        return self.held.get(identity, Counter())[kind]


def share_full(reason: str, limit: int, bound: str = "identity", retry_ms: int = SHARE_RETRY_MS) -> RPCError:
    """The refusal a client reads: which share is full, and when to come back."""
    what = "tickers" if reason == "too_many_tickers" else "channel instances"
    return RPCError(OVERLOADED, f"Too many {what}", reason, limit=limit, bound=bound, retry_after_ms=retry_ms)
