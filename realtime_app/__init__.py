"""realtime_app: flow control for Django Channels, in both directions.

Pure modules (``rate``, ``backpressure``, ``adaptive``, ``protocol``, ``names``) import
without a configured Django project; the names below load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "rate_channel": "rate",
    "is_rate_channel": "rate",
    "parse_rate": "rate",
    "RateBounds": "rate",
    "AdaptiveRate": "adaptive",
    "derive_ladder": "adaptive",
    "decide_send": "backpressure",
    "BackpressureConfig": "backpressure",
    "Decision": "backpressure",
    "DropState": "backpressure",
    "family": "registry",
    "ticker": "registry",
    "state_channel": "registry",
    "event_channel": "registry",
    "ChannelSpec": "registry",
    "publish": "publishing",
    "apublish": "publishing",
    "rpc_method": "consumers",
    "Coalesce": "workers",
    "WriteBehindStore": "write_behind",
    "RealtimeConsumer": "consumers",
    "get_hub": "hub",
    "Guard": "guard",
    "GuardedSendMixin": "guard",
    "RealtimeClient": "client",
    "bind_adaptive_channel": "client",
    "RealtimeError": "exceptions",
    "RPCError": "exceptions",
    "Refused": "exceptions",
    "UnknownChannel": "exceptions",
    "ForbiddenChannel": "exceptions",
    "ConfigurationError": "exceptions",
    "CloseCode": "protocol",
    "BackplaneUnavailable": "exceptions",
    "PublicationError": "exceptions",
    "PublicationTooLarge": "exceptions",
    "Backplane": "backplane",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'realtime_app' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"realtime_app.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
