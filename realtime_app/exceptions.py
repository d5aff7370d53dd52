"""Exceptions of realtime_app.

::

    RealtimeError
    ├── ConfigurationError (also ImproperlyConfigured-like: ValueError)
    ├── ChannelError
    │   ├── UnknownChannel
    │   └── ForbiddenChannel
    └── RPCError                  carries a JSON-RPC error code, reason and data
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChannelError",
    "ConfigurationError",
    "ForbiddenChannel",
    "RPCError",
    "RealtimeError",
    "UnknownChannel",
]


class RealtimeError(Exception):
    """Base class of every error raised by realtime_app."""


class ConfigurationError(RealtimeError, ValueError):
    """A setting or registration breaks an invariant."""


class RPCError(RealtimeError):
    """An error answered to the client as a JSON-RPC error object."""

    def __init__(self, code: int, message: str, reason: str, **data: Any) -> None:
        super().__init__(code, message, reason)
        self.code = code
        self.message = message
        self.reason = reason
        self.data = data

    def __str__(self) -> str:
        return f"{self.message} ({self.reason}, code {self.code})"

    def as_error(self) -> dict[str, Any]:
        """The ``error`` member of the JSON-RPC response."""
        return {"code": self.code, "message": self.message, "data": {"reason": self.reason, **self.data}}


class ChannelError(RPCError):
    """A channel cannot be used as asked."""

    def __init__(self, code: int, message: str, reason: str, channel: str) -> None:
        super().__init__(code, message, reason, channel=channel[:200])
        self.channel = channel


class UnknownChannel(ChannelError):
    """No family, exact channel or event channel has this name."""

    def __init__(self, channel: str) -> None:
        from .protocol import UNKNOWN_CHANNEL

        super().__init__(UNKNOWN_CHANNEL, "Unknown channel", "unknown_channel", channel)


class ForbiddenChannel(ChannelError):
    """The channel policy refuses this user this action on this channel."""

    def __init__(self, channel: str, action: str = "subscribe") -> None:
        from .protocol import FORBIDDEN_CHANNEL

        super().__init__(FORBIDDEN_CHANNEL, f"Forbidden: may not {action} this channel", "forbidden_channel", channel)
        self.action = action
