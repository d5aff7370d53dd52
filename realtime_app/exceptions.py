"""Exceptions of realtime_app.

::

    RealtimeError
    ├── ConfigurationError (also ImproperlyConfigured-like: ValueError)
    ├── BackplaneUnavailable      the backplane (Redis) did not answer
    ├── PublicationError (also ValueError)
    │   └── PublicationTooLarge   the frame would be over MAX_PUBLICATION_BYTES
    └── RPCError                  carries a JSON-RPC error code, reason and data
        ├── ChannelError
        │   ├── UnknownChannel
        │   └── ForbiddenChannel
        └── Refused               admission refused the request: retry_after_ms, snapshot
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from realtime_app.wire.protocol import ErrorObject

__all__ = [
    "BackplaneUnavailable",
    "ChannelError",
    "ConfigurationError",
    "ForbiddenChannel",
    "NO_USER_HINT",
    "OutboxFull",
    "OutcomeUnknown",
    "PublicationError",
    "PublicationTooLarge",
    "REFUSAL_CODES",
    "RPCError",
    "RealtimeError",
    "Refused",
    "UnknownChannel",
    "error_from_response",
]


class RealtimeError(Exception):
    """Base class of every error raised by realtime_app."""


class ConfigurationError(RealtimeError, ValueError):
    """A setting or registration breaks an invariant."""


class BackplaneUnavailable(RealtimeError):
    """The backplane did not answer; the operation may succeed later."""

    def __init__(self, operation: str, cause: BaseException) -> None:
        super().__init__(operation, cause)
        self.operation = operation
        self.cause = cause

    def __str__(self) -> str:
        return f"backplane unavailable during {self.operation}: {type(self.cause).__name__}: {self.cause}"


class PublicationError(RealtimeError, ValueError):
    """A publication cannot be sent: its data is not JSON (``inf``, ``nan``, an object)."""

    def __init__(self, channel: str, problem: str) -> None:
        super().__init__(channel, problem)
        self.channel = channel
        self.problem = problem

    def __str__(self) -> str:
        return f"cannot publish on {self.channel[:200]!r}: {self.problem}"


class PublicationTooLarge(PublicationError):
    """The encoded frame would be over ``MAX_PUBLICATION_BYTES`` (the servers' frame limit)
    or the channel's own ``max_bytes``."""

    def __init__(self, channel: str, size: int, limit: int, bound: str = "MAX_PUBLICATION_BYTES") -> None:
        super().__init__(channel, f"frame of {size} bytes is over {bound} ({limit})")
        self.size = size
        self.limit = limit


class OutboxFull(PublicationError):
    """A durable publication refused: the outbox holds ``OUTBOX_MAX_ROWS`` rows (the
    backplane is down, or nothing drains). A :class:`PublicationError` to the code that
    published; to the client whose call published it, -32003 ``outbox_full`` with
    ``limit`` and ``retry_after_ms`` (:meth:`as_rpc`), never an internal error."""

    def __init__(self, channel: str, limit: int, retry_after_ms: int) -> None:
        super().__init__(
            channel, f"the outbox is full (OUTBOX_MAX_ROWS {limit}): the backplane is down or nothing drains"
        )
        self.limit = limit
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple[type[OutboxFull], tuple[str, int, int]]:
        return (OutboxFull, (self.channel, self.limit, self.retry_after_ms))

    def as_rpc(self) -> RPCError:
        return RPCError(-32003, "Outbox full", "outbox_full", limit=self.limit, retry_after_ms=self.retry_after_ms)


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

    def as_error(self) -> ErrorObject:
        """The ``error`` member of the JSON-RPC response."""
        return {"code": self.code, "message": self.message, "data": {"reason": self.reason, **self.data}}  # type: ignore[typeddict-item]


class ChannelError(RPCError):
    """A channel cannot be used as asked."""

    def __init__(self, code: int, message: str, reason: str, channel: str) -> None:
        super().__init__(code, message, reason, channel=channel[:200])
        self.channel = channel


class UnknownChannel(ChannelError):
    """No family, exact channel or event channel has this name."""

    def __init__(self, channel: str) -> None:
        from realtime_app.wire.protocol import UNKNOWN_CHANNEL

        super().__init__(UNKNOWN_CHANNEL, "Unknown channel", "unknown_channel", channel)


class ForbiddenChannel(ChannelError):
    """The channel policy refuses this user this action on this channel."""

    def __init__(self, channel: str, action: str = "subscribe", hint: str | None = None) -> None:
        from realtime_app.wire.protocol import FORBIDDEN_CHANNEL

        super().__init__(FORBIDDEN_CHANNEL, f"Forbidden: may not {action} this channel", "forbidden_channel", channel)
        self.action = action
        if hint is not None:  # why, when the server can tell (a connection without a user)
            self.data["hint"] = hint


#: The ``hint`` of a refusal on a connection that has no user at all (docs/checks.md, W041).
NO_USER_HINT = (
    "this connection has no user: the WebSocket application is not wrapped in "
    "channels.auth.AuthMiddlewareStack (or another middleware that sets scope['user'])"
)


#: JSON-RPC codes of "not now" answers (docs/admission.md): nothing ran.
REFUSAL_CODES = (-32003, -32004, -32005)


class Refused(RPCError):
    """A request refused before any work (``overloaded``, ``too_many_in_flight``,
    ``rate_limited``): come back after ``retry_after_ms``; ``snapshot`` is the state to
    resync to when the method declares one; ``limit`` the limit that applied."""

    @property
    def retry_after_ms(self) -> int:
        return int(self.data.get("retry_after_ms", 0))

    @property
    def snapshot(self) -> Any:
        return self.data.get("snapshot")

    @property
    def limit(self) -> Any:
        return self.data.get("limit")


class OutcomeUnknown(RealtimeError, ConnectionError):
    """The connection was lost after a call was sent and before its answer came: it may
    have run or not. Clients retry only calls made ``idempotent`` (with a key the server
    answers once); any other call raises this, and the application decides."""


def error_from_response(error: dict[str, Any]) -> RPCError:
    """The exception of a JSON-RPC error object: :class:`Refused` for a refusal."""
    data = error.get("data") or {}
    if not isinstance(data, dict):
        data = {}
    retry = data.get("retry_after_ms")
    refused = error.get("code") in REFUSAL_CODES and isinstance(retry, (int, float)) and not isinstance(retry, bool)
    cls = Refused if refused else RPCError
    extra = {k: v for k, v in data.items() if k != "reason"}
    return cls(error.get("code", 0), error.get("message", ""), data.get("reason", ""), **extra)
