"""Which channels exist: cadenced families, exact state channels, event channels.

A **family** owns ``base`` and every ``base:<ms>``; its factory is called when one of
those channels gets its first subscriber in the cluster and its cleanup after the last
leaves. An **exact** channel is one fixed state channel with an optional factory. An
**event** channel is published by application code only and never cadenced.

Registration happens at import time of each app's ``realtime_channels`` module.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from realtime_app.exceptions import ConfigurationError, UnknownChannel
from realtime_app.wire.history import HistoryPolicy
from realtime_app.wire.rate import RateBounds, is_rate_channel, parse_rate, rate_channel

__all__ = [
    "ChannelKind",
    "ChannelSpec",
    "Family",
    "Registry",
    "event_channel",
    "family",
    "registry",
    "state_channel",
    "ticker",
]

logger = logging.getLogger("realtime_app.registry")

#: The backplane channel of the cluster's own control messages (``hub.CONTROL_CHANNEL``).
RESERVED = "realtime.control"

Publish: TypeAlias = Callable[[Any], None]
Cleanup: TypeAlias = Callable[[], Any]
Factory: TypeAlias = Callable[["ChannelSpec", Publish], "Cleanup | None | Awaitable[Cleanup | None]"]
ChannelKind: TypeAlias = Literal["state", "event"]


@dataclass(frozen=True, slots=True)
class ChannelSpec:
    """A resolved channel: its canonical name and what serves it.

    ``str(spec)`` is the name, so a factory may treat it as the channel string.
    """

    name: str
    kind: ChannelKind
    base: str
    interval_ms: int | None = None
    factory: Factory | None = field(default=None, compare=False, repr=False)
    history: HistoryPolicy | None = None  # event channels that keep their past (docs/recovery.md)
    max_bytes: int = 0  # an event channel's own bound on a publication (0: MAX_PUBLICATION_BYTES)

    def __str__(self) -> str:
        return self.name

    @property
    def has_ticker(self) -> bool:
        """True when a factory runs (one per cluster) while the channel has subscribers."""
        return self.factory is not None


@dataclass(frozen=True, slots=True)
class Family:
    """A cadenced state family: ``base`` at the default cadence, ``base:<ms>`` otherwise."""

    base: str
    bounds: RateBounds
    factory: Factory

    def resolve(self, name: str) -> ChannelSpec | None:
        ms = parse_rate(name, self.base, self.bounds)
        if ms is None:
            return None
        canonical = rate_channel(self.base, ms, self.bounds.default)
        return ChannelSpec(canonical, "state", self.base, ms, self.factory)


class Registry:
    """The channels this process knows, by name and by family base."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}
        self.exact: dict[str, ChannelSpec] = {}

    def clear(self) -> None:
        self.families.clear()
        self.exact.clear()

    def _check_free(self, name: str) -> None:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigurationError(f"channel name must be a non-empty string without outer spaces, got {name!r}")
        if name in self.families or name in self.exact:
            raise ConfigurationError(f"channel {name!r} is already registered")
        if name == RESERVED:
            raise ConfigurationError(f"channel name {name!r} is reserved for the cluster's control messages")
        base, _, suffix = name.rpartition(":")
        if base in self.families and suffix.isascii() and suffix.isdigit():
            raise ConfigurationError(f"channel {name!r} is a cadence of family {base!r}")

    def add_family(self, base: str, factory: Factory, *, default: int, min: int, max: int) -> Family:
        """Register a cadenced family; ``default``, ``min``, ``max`` in milliseconds."""
        self._check_free(base)
        for key, value in (("default", default), ("min", min), ("max", max)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigurationError(
                    f"family {base!r}: {key} must be an int of milliseconds (e.g. {key}=1000), got {value!r}"
                )
        if not 0 < min <= default <= max:
            raise ConfigurationError(
                f"family {base!r}: need 0 < min <= default <= max, got min={min} default={default} max={max}"
            )
        if not callable(factory):
            raise ConfigurationError(f"family {base!r}: factory must be callable, got {factory!r}")
        fam = Family(base, RateBounds(default, min, max), factory)
        self.families[base] = fam
        return fam

    def add_channel(
        self,
        name: str,
        kind: ChannelKind,
        factory: Factory | None = None,
        history: HistoryPolicy | None = None,
        max_bytes: int = 0,
    ) -> ChannelSpec:
        """Register an exact state channel (optional factory) or an event channel (none,
        optional history)."""
        self._check_free(name)
        if kind == "event" and factory is not None:
            raise ConfigurationError(f"event channel {name!r} cannot have a factory: application code publishes it")
        if history is not None and kind != "event":
            raise ConfigurationError(f"channel {name!r}: only event channels keep a history")
        spec = ChannelSpec(name, kind, name, None, factory, history, max_bytes)
        self.exact[name] = spec
        return spec

    def resolve(self, name: str) -> ChannelSpec:
        """The channel ``name`` refers to, canonicalised; raises :class:`UnknownChannel`."""
        spec = self.exact.get(name)
        if spec is not None:
            return spec
        fam = self.families.get(name)
        if fam is None:
            base, sep, _ = name.rpartition(":")
            fam = self.families.get(base) if sep else None
        if fam is not None:
            resolved = fam.resolve(name)
            if resolved is not None:
                return resolved
        raise UnknownChannel(name)

    def family_of(self, name: str) -> Family | None:
        """The family whose base or cadence (``base:<ASCII digits>``) ``name`` is, if any;
        ``base:chat`` is not a cadence, so not of the family (its rules do not apply)."""
        if name in self.families:
            return self.families[name]
        base, sep, _ = name.rpartition(":")
        fam = self.families.get(base) if sep else None
        return fam if fam is not None and is_rate_channel(name, base) else None


registry = Registry()


def family(base: str, *, default: int = 1000, min: int = 100, max: int = 60000) -> Callable[[Factory], Factory]:
    """Decorator: register ``factory(channel, publish) -> cleanup | None`` for a cadenced family.

    The factory is called once per cadence channel in the whole cluster, when that
    channel gets its first subscriber; ``channel.interval_ms`` is the cadence. It must not
    capture the connection that triggered it.
    """

    def register(factory: Factory) -> Factory:
        registry.add_family(base, factory, default=default, min=min, max=max)
        return factory

    return register


def ticker(
    base: str, *, default: int = 1000, min: int = 100, max: int = 60000
) -> Callable[[Callable[[ChannelSpec], Any]], Callable[[ChannelSpec], Any]]:
    """Decorator: a cadenced family whose frames are ``tick(channel)`` every cadence.

    ``tick`` may be sync (keep it quick: it runs on the event loop) or async. It runs on
    one process of the cluster, on a drift-free schedule; a slow tick skips missed beats
    instead of bursting.
    """

    def register(tick: Callable[[ChannelSpec], Any]) -> Callable[[ChannelSpec], Any]:
        def factory(channel: ChannelSpec, publish: Publish) -> Cleanup:
            task = asyncio.get_running_loop().create_task(_run_ticker(channel, tick, publish))
            return task.cancel

        factory.__name__ = f"ticker_{getattr(tick, '__name__', 'tick')}"
        registry.add_family(base, factory, default=default, min=min, max=max)
        return tick

    return register


async def _run_ticker(channel: ChannelSpec, tick: Callable[[ChannelSpec], Any], publish: Publish) -> None:
    assert channel.interval_ms is not None
    period = channel.interval_ms / 1000
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    failing = False
    while True:
        try:
            data = tick(channel)
            if inspect.isawaitable(data):
                data = await data
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not failing:  # log once per failure streak, not once per beat
                logger.exception("tick of %s failed", channel.name)
            failing = True
            report = getattr(publish, "failed", None)  # the probe shows the ticker failing
            if report is not None:
                report(exc)
        else:
            failing = False
            publish(data)
        deadline += period
        now = loop.time()
        if deadline < now:  # late: skip the missed beats
            deadline = now + period - ((now - deadline) % period)
        await asyncio.sleep(deadline - now)


def state_channel(name: str) -> Callable[[Factory], Factory]:
    """Decorator: an exact (uncadenced) state channel served by ``factory(channel, publish)``."""

    def register(factory: Factory) -> Factory:
        registry.add_channel(name, "state", factory)
        return factory

    return register


#: Most publications one channel may keep (each is kept whole, on the backplane).
MAX_HISTORY_SIZE = 100_000


def event_channel(name: str, *, history_size: int = 0, history_ttl_s: int = 300, max_bytes: int = 0) -> ChannelSpec:
    """Register an event channel: every message counts, published with ``publish()``.

    ``history_size`` > 0 keeps the last that many publications, none older than
    ``history_ttl_s``, so that a client that missed some (a drop, a 1013, a reconnect)
    gets them again by subscribing ``since`` the last it saw (docs/recovery.md).
    ``max_bytes`` > 0 bounds this channel's publications (their whole frame) below
    ``MAX_PUBLICATION_BYTES``: what a history holds is then at most ``history_size ×
    max_bytes`` — worth setting on a channel that clients may publish on.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ConfigurationError(f"event channel {name!r}: max_bytes must be an integer >= 0, got {max_bytes!r}")
    history = None
    if isinstance(history_size, bool) or not isinstance(history_size, int) or not 0 <= history_size <= MAX_HISTORY_SIZE:
        raise ConfigurationError(
            f"event channel {name!r}: history_size must be an integer 0..{MAX_HISTORY_SIZE}, got {history_size!r}"
        )
    if history_size:
        if isinstance(history_ttl_s, bool) or not isinstance(history_ttl_s, int) or history_ttl_s < 1:
            raise ConfigurationError(
                f"event channel {name!r}: history_ttl_s must be a positive integer, got {history_ttl_s!r}"
            )
        history = HistoryPolicy(history_size, history_ttl_s)
    return registry.add_channel(name, "event", history=history, max_bytes=max_bytes)
