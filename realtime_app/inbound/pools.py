"""This process's HTTP concurrency pools, built from ``REALTIME_APP["HTTP_POOLS"]``: kept
here, below the middleware that uses them and the hub whose probe reports them."""

from __future__ import annotations

from typing import Any

from realtime_app.conf import get_config
from realtime_app.inbound.limiter import ConcurrencyPool, PoolSettings

__all__ = ["decorated_pools", "http_pools", "pools_probe"]

#: Pools named by a decorator somewhere (checked against the settings by realtime_app.E021).
decorated_pools: set[str] = set()
_pools: dict[str, ConcurrencyPool] = {}
_built_from: dict[str, Any] | None = None


def http_pools() -> dict[str, ConcurrencyPool]:
    """This process's pools, built from the settings on first use (and again if they change)."""
    global _built_from
    config = get_config()["HTTP_POOLS"]
    if config != _built_from:
        _pools.clear()
        _built_from = config
        for name, options in config.items():
            settings = PoolSettings(
                max_concurrent=options["max_concurrent"],
                max_waiting=options.get("max_waiting", 100),
                wait_timeout_ms=options.get("wait_timeout_ms", 10_000),
            )
            _pools[name] = ConcurrencyPool(name, settings)
    return _pools


def pools_probe() -> dict[str, dict[str, Any]]:
    """Every pool's counters (the probe's ``http_pools``)."""
    return {name: pool.probe() for name, pool in sorted(http_pools().items())}
