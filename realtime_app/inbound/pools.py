"""This process's HTTP concurrency pools, built from ``REALTIME_APP["HTTP_POOLS"]``: kept
here, below the middleware that uses them and the hub whose probe reports them."""

from __future__ import annotations

import threading
from typing import Any

from realtime_app.conf.runtime import runtime, settings
from realtime_app.inbound.limiter import ConcurrencyPool, PoolSettings

__all__ = ["HttpPools", "decorated_pools", "http_pools", "pools_probe"]

#: Pools named by a decorator somewhere (checked against the settings by realtime_app.E021):
#: declared at import time, like the channels and the methods, so not runtime state.
decorated_pools: set[str] = set()


class HttpPools:
    """The process's pools (a part of its runtime), built from ``HTTP_POOLS`` on first use
    and again when it changes (compared by value)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # sync views' threads ask for them too
        self.pools: dict[str, ConcurrencyPool] = {}
        self.built_from: dict[str, Any] | None = None


def http_pools() -> dict[str, ConcurrencyPool]:
    """This process's pools, built from the settings on first use (and again if they change)."""
    kept = runtime().part(HttpPools)
    config = settings().http_pools
    if config == kept.built_from:  # compared by value: another setting's change keeps them
        return kept.pools
    with kept.lock:
        if config == kept.built_from:
            return kept.pools
        pools = {}
        for name, options in config.items():
            limits = PoolSettings(
                max_concurrent=options["max_concurrent"],
                max_waiting=options.get("max_waiting", 100),
                wait_timeout_ms=options.get("wait_timeout_ms", 10_000),
            )
            pools[name] = ConcurrencyPool(name, limits)
        kept.pools, kept.built_from = pools, config
    return kept.pools


def pools_probe() -> dict[str, dict[str, Any]]:
    """Every pool's counters (the probe's ``http_pools``)."""
    return {name: pool.probe() for name, pool in sorted(http_pools().items())}
