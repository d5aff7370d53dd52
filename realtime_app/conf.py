"""Settings: one ``REALTIME_APP`` dict, defaults here, merged lazily, reset on change.

Read through :func:`get_config` inside functions, never at import time, so that
``override_settings`` works and pure modules stay importable without Django.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["DEFAULTS", "get_config", "reset_config"]

DEFAULTS: dict[str, Any] = {
    # Channel access rules (see docs/configuration.md). The most specific rule wins; a rule
    # on a family's base name guards every cadence of that family.
    "POLICIES": [],
    # Rules always appended after the user's (the user's own rule on the same pattern wins).
    "BUILTIN_POLICIES": [{"pattern": "realtime:socket", "staff": True}],
    # Modules named so in each installed app are imported at startup to register channels.
    "AUTODISCOVER_MODULE": "realtime_channels",
    # Largest inbound WebSocket text frame, bytes; over it the connection closes with 1009.
    "MAX_FRAME_BYTES": 64 * 1024,
    # Most requests in one JSON-RPC batch; over it the batch is refused (-32600).
    "MAX_BATCH": 50,
    # Longest channel name a client may name, characters.
    "MAX_CHANNEL_NAME": 200,
    # Subscriptions one connection may hold at once; 0 = unlimited.
    "MAX_SUBSCRIPTIONS": 100,
    # Backplane: "auto" = Redis when the default channel layer is channels-redis, else
    # in-process. Or a dotted path to a Backplane class.
    "BACKPLANE": "auto",
    # Redis URL of the backplane; None = taken from the channel layer's first host.
    "REDIS_URL": None,
    # Prefix of every Redis key the backplane writes (leases, sequences, probes).
    "KEY_PREFIX": "realtime",
    # Lifetime of a ticker lease, milliseconds: the failover time when a process dies.
    "LEASE_TTL_MS": 3000,
    # Lifetime of a published process probe, milliseconds; it is republished every third.
    "PROBE_TTL_MS": 6000,
    # Transport backpressure (SPEC §5): bytes (0 disables), "drop" | "close", balance.
    "MAX_BACKPRESSURE": 4 * 1024 * 1024,
    "BACKPRESSURE_POLICY": "drop",
    "CLOSE_AFTER_DROPS": 1000,
    # Connections at or above this many queued bytes count as slow consumers (no action).
    "SLOW_CONSUMER_BYTES": 1024 * 1024,
    # After a 1013 close, how long queued frames may still drain before the drop, ms.
    "CLOSE_DRAIN_MS": 10000,
    # JSON-RPC responses are written even over the threshold (they still count as drops).
    "NEVER_DROP_RESPONSES": True,
    # Who may read /realtime/metrics besides staff: a bearer token, or None.
    "METRICS_TOKEN": None,
}


@cache
def get_config() -> dict[str, Any]:
    """The effective settings: the user's ``REALTIME_APP`` merged over :data:`DEFAULTS`."""
    from django.conf import settings

    user = getattr(settings, "REALTIME_APP", None) or {}
    return {**DEFAULTS, **user}


def reset_config(*, setting: str, **kwargs: Any) -> None:
    """``setting_changed`` receiver: forget the cached config when the settings change."""
    if setting in ("REALTIME_APP", "CHANNEL_LAYERS"):
        get_config.cache_clear()
        from .policies import active_rules

        active_rules.cache_clear()
