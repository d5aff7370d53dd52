"""Declaring channels: the decorators and functions of a ``realtime_channels`` module.

Each registers with the process's :data:`~realtime_app.declarations.registry.registry` at
import; any name may be a template (``"lot:<int:id>"``, docs/channels-per-object.md).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeAlias

from realtime_app.declarations.registry import (
    STATE_TTL_S,
    ChannelSpec,
    Cleanup,
    Declared,
    Factory,
    Family,
    Publish,
    registry,
)
from realtime_app.exceptions import ConfigurationError
from realtime_app.wire.history import HistoryPolicy

__all__ = ["MAX_HISTORY_SIZE", "Exists", "app_state", "event_channel", "family", "state_channel", "ticker"]

logger = logging.getLogger("realtime_app.registry")


#: What a template's instances may be given, beside what the channel is
#: (:meth:`Registry._add_template`): ``exists(params) -> bool`` (sync or async), ``owner``
#: (the parameter that must be the subscriber's user id), ``max_instances``, and ``public``
#: (open to every client without a rule; a template is closed until a rule matches it).
Exists: TypeAlias = Callable[[dict[str, Any]], Any]


def family(
    base: str,
    *,
    default: int = 1000,
    min: int = 100,
    max: int = 60000,
    exists: Exists | None = None,
    owner: str | None = None,
    max_instances: int = 0,
    presence: bool = False,
    public: bool = False,
) -> Callable[[Factory], Factory]:
    """Decorator: register ``factory(channel, publish) -> cleanup | None`` for a cadenced family.

    The factory is called once per cadence channel in the whole cluster, when that
    channel gets its first subscriber; ``channel.interval_ms`` is the cadence (and
    ``channel.params`` the values of a template's instance). It must not capture the
    connection that triggered it.
    """

    def register(factory: Factory) -> Factory:
        registry.add_family(
            base,
            factory,
            default=default,
            min=min,
            max=max,
            exists=exists,
            owner=owner,
            max_instances=max_instances,
            presence=_presence(base, presence),
            public=public,
        )
        return factory

    return register


def ticker(
    base: str,
    *,
    default: int = 1000,
    min: int = 100,
    max: int = 60000,
    exists: Exists | None = None,
    owner: str | None = None,
    max_instances: int = 0,
    presence: bool = False,
    public: bool = False,
) -> Callable[[Callable[[ChannelSpec], Any]], Callable[[ChannelSpec], Any]]:
    """Decorator: a cadenced family whose frames are ``tick(channel)`` every cadence.

    ``tick`` may be sync (keep it quick: it runs on the event loop) or async. It runs on
    one process of the cluster, on a drift-free schedule; a slow tick skips missed beats
    instead of bursting. ``base`` may be a template (``"room:<slug:name>:load"``): one
    ticker per instance and cadence, ``channel.params`` its values.
    """

    def register(tick: Callable[[ChannelSpec], Any]) -> Callable[[ChannelSpec], Any]:
        def factory(channel: ChannelSpec, publish: Publish) -> Cleanup:
            task = asyncio.get_running_loop().create_task(_run_ticker(channel, tick, publish))
            return task.cancel

        factory.__name__ = f"ticker_{getattr(tick, '__name__', 'tick')}"
        factory.tick = tick  # type: ignore[attr-defined]  # realtime_app.testing.tick runs it once, now
        registry.add_family(
            base,
            factory,
            default=default,
            min=min,
            max=max,
            exists=exists,
            owner=owner,
            max_instances=max_instances,
            presence=_presence(base, presence),
            public=public,
        )
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


def app_state(
    base: str,
    *,
    default: int = 1000,
    min: int = 100,
    max: int = 60000,
    ttl_s: int = STATE_TTL_S,
    exists: Exists | None = None,
    owner: str | None = None,
    max_instances: int = 0,
    presence: bool = False,
    public: bool = False,
) -> Family | Declared:
    """Register an app-fed state family: the application sets its value when it changes
    — ``publish(base, value)`` from a view, a signal, a task — and each cadence
    (``base``, ``base:<ms>``) delivers the latest value at most once per period, only
    when it changed since that cadence's last frame, with no ticker polling anything.

    The value is kept on the backplane for ``ttl_s`` seconds after it was last set, so a
    new subscriber, in any process, gets it at once (docs/channels-per-object.md).
    """
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
        raise ConfigurationError(f"app-fed state {base!r}: ttl_s must be a positive integer, got {ttl_s!r}")
    return registry.add_family(
        base,
        None,
        default=default,
        min=min,
        max=max,
        fed=HistoryPolicy(1, ttl_s),
        exists=exists,
        owner=owner,
        max_instances=max_instances,
        presence=_presence(base, presence),
        public=public,
    )


def state_channel(
    name: str,
    *,
    exists: Exists | None = None,
    owner: str | None = None,
    max_instances: int = 0,
    presence: bool = False,
    public: bool = False,
) -> Callable[[Factory], Factory]:
    """Decorator: an exact (uncadenced) state channel served by ``factory(channel, publish)``."""

    def register(factory: Factory) -> Factory:
        registry.add_channel(
            name,
            "state",
            factory,
            exists=exists,
            owner=owner,
            max_instances=max_instances,
            presence=_presence(name, presence),
            public=public,
        )
        return factory

    return register


#: Most publications one channel may keep (each is kept whole, on the backplane).
MAX_HISTORY_SIZE = 100_000


def event_channel(
    name: str,
    *,
    history_size: int = 0,
    history_ttl_s: int = 300,
    max_bytes: int = 0,
    exists: Exists | None = None,
    owner: str | None = None,
    max_instances: int = 0,
    durable: bool = False,
    presence: bool = False,
    public: bool = False,
) -> ChannelSpec | Declared:
    """Register an event channel: every message counts, published with ``publish()``.

    ``history_size`` > 0 keeps the last that many publications, none older than
    ``history_ttl_s``, so that a client that missed some (a drop, a 1013, a reconnect)
    gets them again by subscribing ``since`` the last it saw (docs/recovery.md).
    ``max_bytes`` > 0 bounds this channel's publications (their whole frame) below
    ``MAX_PUBLICATION_BYTES``: what a history holds is then at most ``history_size ×
    max_bytes`` — worth setting on a channel that clients may publish on.

    ``name`` may be a template (``"bids:<int:lot>"``): each instance keeps its own history.

    ``durable`` (a history required): a publication made inside a transaction is written
    to the outbox table in that transaction and published from there once it committed —
    through a Redis outage, after a process was killed — each exactly once, in order
    (docs/transactions.md).

    ``presence`` (on any channel, template or family): who is in it is kept across the
    cluster and told to subscribers that ask, once per ``PRESENCE_INTERVAL_MS`` at most
    (docs/presence.md).
    """
    if durable and not history_size:
        raise ConfigurationError(f"event channel {name!r}: durable=True needs a history (history_size > 0)")
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
        history = HistoryPolicy(history_size, history_ttl_s, durable=bool(durable))
    return registry.add_channel(
        name,
        "event",
        history=history,
        max_bytes=max_bytes,
        exists=exists,
        owner=owner,
        max_instances=max_instances,
        presence=_presence(name, presence),
        public=public,
    )


def _presence(name: str, presence: Any) -> bool:
    if not isinstance(presence, bool):
        raise ConfigurationError(f"channel {name!r}: presence must be True or False, got {presence!r}")
    return presence
