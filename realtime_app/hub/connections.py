"""One WebSocket connection as the hub sees it."""

from __future__ import annotations

import itertools
import time
from dataclasses import InitVar, dataclass, field
from typing import Any

from realtime_app.conf.runtime import runtime
from realtime_app.outbound.base import Transport
from realtime_app.outbound.guard import Guard
from realtime_app.wire.asgi import Scope, Send

__all__ = ["Connection", "ConnectionIds"]


class ConnectionIds:
    """The process's connection numbers, from 1 (a part of its runtime)."""

    def __init__(self) -> None:
        self.next = itertools.count(1).__next__


def _next_id() -> int:
    return runtime().part(ConnectionIds).next()


@dataclass(eq=False, slots=True)
class Connection:
    """One connection (a WebSocket, an SSE stream): its guarded transport, its identity, its channels."""

    send: Send
    scope: Scope = field(default_factory=dict, repr=False)
    id: int = field(default_factory=_next_id)
    subscriptions: set[str] = field(default_factory=set)
    closed: bool = False
    identity: tuple[str, str] | None = None
    #: Whose shares of tickers and instances its subscriptions count in (hub.shares): its
    #: identity, the user's once it signs in with RPC ``auth``.
    owner: tuple[str, str] | None = None
    address: str | None = None  # the client's, read through TRUSTED_PROXIES (the probe shows it)
    unread_bytes: int = 0  # answers written over the threshold since the queue was last under it
    #: Per channel with history: the (epoch, seq) last sent, below which nothing is sent again.
    positions: dict[str, tuple[str, int]] = field(default_factory=dict)
    opened_at: float = field(default_factory=time.monotonic)
    #: Delta subscriptions: channel -> the ``seq`` of the last frame it was sent there (-1: none yet).
    deltas: dict[str, int] = field(default_factory=dict)
    #: In presence channels: its user's name (None: anonymous) and public info; None until
    #: its first subscribe to one (``realtime_app.hub.presence.member_of``).
    member: tuple[str | None, Any] | None = None
    guard: Guard = field(init=False, repr=False)
    #: The transport when it is not the server's socket behind ``send`` (an SSE stream's).
    transport: InitVar[Transport | None] = None

    def __post_init__(self, transport: Transport | None) -> None:
        self.guard = Guard(self.send, transport=transport)
