"""What a subscribe may start in this process: which channel a name is (instances of
templates asked whether they exist), and the bounds on what clients can make it run —
cadences per family, tickers, live instances of templates."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from realtime_app.declarations.instances import exists
from realtime_app.declarations.registry import ChannelSpec, registry
from realtime_app.exceptions import RPCError, UnknownChannel
from realtime_app.wire import protocol
from realtime_app.wire.rate import nearest_cadence, rate_channel

if TYPE_CHECKING:
    from realtime_app.conf.typed import Settings
    from realtime_app.hub.core import Hub

__all__ = ["INSTANCE_RETRY_MS", "bounded", "instance_refusal", "require_existing"]

#: When a subscribe refused for ``too_many_instances`` or ``too_many_tickers`` may come back.
INSTANCE_RETRY_MS = 5000


async def require_existing(spec: ChannelSpec) -> None:
    """:class:`UnknownChannel` for an instance its template's ``exists`` denies. Asked
    after the policy: who may not see a channel learns nothing of which objects exist,
    and costs no query."""
    if not await exists(spec):
        raise UnknownChannel(spec.name)


async def bounded(
    hub: Hub,
    spec: ChannelSpec,
    config: Settings,
    require: Callable[[ChannelSpec], Awaitable[None]],
    anonymous: bool = False,
) -> ChannelSpec:
    """Keep what clients can start bounded: past ``MAX_CADENCES_PER_FAMILY`` the nearest
    running cadence instead of a new one (``require``-d again); past ``MAX_TICKERS``, or
    the bounds on live instances of templates, a refusal. An ``anonymous`` subscriber
    never takes the last ``SIGNED_IN_RESERVE`` of them (``bound: "anonymous"``); each
    identity's own share is the hub's (:mod:`realtime_app.hub.shares`)."""
    share = 1 - float(config.signed_in_reserve) if anonymous else 1.0
    family = registry.family_of(spec.name)
    cap = config.max_cadences_per_family
    if family is not None and spec.interval_ms is not None and cap:
        running = hub.running_cadences(family.base)
        if len(running) >= cap:
            ms = nearest_cadence(spec.interval_ms, running)
            spec = registry.resolve(rate_channel(family.base, ms, family.bounds.default))
            await require(spec)
            hub.count_refusal("cadences")
            return spec
    refused = instance_refusal(hub, spec, config, share)
    if refused is not None:
        which, limit = refused
        hub.count_refusal("instances")
        raise RPCError(
            protocol.OVERLOADED,
            "Too many channel instances",
            "too_many_instances",
            limit=limit,
            bound=which,
            retry_after_ms=INSTANCE_RETRY_MS,
        )
    tickers = config.max_tickers
    if spec.has_ticker and tickers and hub.ticker_count() >= shared(tickers, share):
        bound, limit = ("process", tickers) if hub.ticker_count() >= tickers else ("anonymous", shared(tickers, share))
        hub.count_refusal("tickers")
        raise RPCError(
            protocol.OVERLOADED,
            "Too many tickers",
            "too_many_tickers",
            limit=limit,
            bound=bound,
            retry_after_ms=INSTANCE_RETRY_MS,
        )
    return spec


def shared(limit: int, share: float) -> int:
    """What of ``limit`` (0: none) a subscriber with ``share`` of it may fill: at least one."""
    return limit if not limit or share >= 1 else max(1, int(limit * share))


def instance_refusal(hub: Hub, spec: ChannelSpec, config: Settings, share: float = 1.0) -> tuple[str, int] | None:
    """Which bound a new instance of a template would pass in ``hub``'s process
    (``MAX_INSTANCES``, ``MAX_INSTANCES_PER_TEMPLATE`` or the template's own
    ``max_instances``; ``"anonymous"`` when only an anonymous subscriber's ``share`` of
    them is full), or None."""
    declared = spec.declared
    if declared is None:
        return None
    limits = (declared.max_instances or config.max_instances_per_template, config.max_instances)
    refused = hub.instances.refusal(declared.pattern, spec.base, *limits)
    if refused is not None or share >= 1:
        return refused
    anonymous = hub.instances.refusal(declared.pattern, spec.base, *(shared(n, share) for n in limits))
    return None if anonymous is None else ("anonymous", anonymous[1])
