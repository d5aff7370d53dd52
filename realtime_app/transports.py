"""What the ASGI ``send`` cannot do, done on the server's own transport (fragile, isolated).

Daphne hands each application ``functools.partial(server.handle_reply, protocol)`` as its
``send``; through it we reach the autobahn protocol of the connection. Autobahn's public
``sendClose`` refuses every code but 1000 and 3000–4999, so the codes of the protocol
(1003, 1008, 1009, 1013) must go through ``sendCloseFrame``. Everything here is pinned to
daphne 4.2 / autobahn 26 and covered by an integration test that breaks if they move.
Any other server (uvicorn, the Channels test communicator) gets the plain ASGI close.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["close", "daphne_protocol", "direct_writer", "server_send"]


def server_send(send: Callable[..., Any]) -> Callable[..., Any]:
    """The server's own ``send`` under Channels' middleware wrappers.

    ``SessionMiddleware`` (in ``AuthMiddlewareStack``) hands the application a bound
    ``send`` of a wrapper holding the server's as ``real_send``; unwrap every such layer.
    """
    for _ in range(10):
        owner = getattr(send, "__self__", None)
        inner = getattr(owner, "real_send", None)
        if inner is None:
            break
        send = inner
    return send


def daphne_protocol(send: Callable[..., Any]) -> Any | None:
    """The autobahn/daphne WebSocket protocol behind ``send``, or None elsewhere."""
    send = server_send(send)
    if isinstance(send, functools.partial) and send.args:
        protocol = send.args[0]
        if hasattr(protocol, "sendCloseFrame") and hasattr(protocol, "handle_reply"):
            return protocol
    return None


async def close(send: Callable[..., Any], code: int, reason: str = "") -> None:
    """Close the WebSocket with ``code`` (any valid close code) and a short reason."""
    protocol = daphne_protocol(send)
    if protocol is not None:
        payload = reason.encode("utf-8")[:123] or None
        protocol.sendCloseFrame(code=int(code), reasonUtf8=payload, isReply=False)
        return
    await send({"type": "websocket.close", "code": int(code), "reason": reason})


def direct_writer(send: Callable[..., Any]) -> Callable[[bytes], bool] | None:
    """A synchronous ``write(utf8_payload) -> sent`` straight to the server's protocol.

    The fan-out encodes a frame once and writes the same bytes to every subscriber,
    skipping per-connection ASGI dicts, middleware hops and re-encoding. Under daphne the
    asyncio loop and Twisted's reactor share one thread, so this is what daphne's own
    ``handle_reply`` does. None where no such path exists (then use the ASGI ``send``).
    """
    protocol = daphne_protocol(send)
    if protocol is None:
        return None
    open_state = protocol.STATE_OPEN

    def write(payload: bytes) -> bool:
        if protocol.state != open_state:
            return False
        protocol.sendMessage(payload, False)
        return True

    return write
