"""realtime_app: flow control for Django Channels, in both directions.

The pure modules (``wire``, ``outbound.backpressure``, ``client``) import without a
configured Django project; the names below load lazily from the subpackages.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "rate_channel": "wire.rate",
    "is_rate_channel": "wire.rate",
    "parse_rate": "wire.rate",
    "RateBounds": "wire.rate",
    "AdaptiveRate": "client.adaptive",
    "derive_ladder": "client.adaptive",
    "decide_send": "outbound.backpressure",
    "BackpressureConfig": "outbound.backpressure",
    "Decision": "outbound.backpressure",
    "DropState": "outbound.backpressure",
    "family": "declarations.declare",
    "ticker": "declarations.declare",
    "state_channel": "declarations.declare",
    "event_channel": "declarations.declare",
    "app_state": "declarations.declare",
    "ChannelName": "declarations.templates",
    "forget_exists": "declarations.instances",
    "ChannelSpec": "declarations.registry",
    "publish": "hub.publishing",
    "apublish": "hub.publishing",
    "rpc_method": "endpoint.consumer",
    "Coalesce": "inbound.workers",
    "WriteBehindStore": "persistence.write_behind",
    "WriteRefused": "persistence.write_behind",
    "RealtimeConsumer": "endpoint.consumer",
    "get_hub": "hub",
    "Guard": "outbound.guard",
    "GuardedSendMixin": "outbound.guard",
    "RealtimeClient": "client",
    "bind_adaptive_channel": "client",
    "RealtimeError": "exceptions",
    "RPCError": "exceptions",
    "Refused": "exceptions",
    "UnknownChannel": "exceptions",
    "ForbiddenChannel": "exceptions",
    "ConfigurationError": "exceptions",
    "CloseCode": "wire.protocol",
    "BackplaneUnavailable": "exceptions",
    "OutboxFull": "exceptions",
    "PublicationError": "exceptions",
    "PublicationTooLarge": "exceptions",
    "Backplane": "cluster.base",
    "Realtime": "conf.runtime",
    "runtime": "conf.runtime",
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
