"""The server's own transport of a connection: bytes still queued, direct writes, real closes.

ASGI hides all three. Under daphne ``await send()`` never blocks, so a client that stops
reading makes Twisted's write buffer (and the process) grow without bound; under uvicorn
``await send()`` blocks on flow control, so one dead client stalls whoever awaits it; and
daphne's autobahn refuses to send 1003/1008/1009/1013 through the ASGI close. This module
reaches past ASGI, per server, and is the only one that does:

* **daphne** (4.2, autobahn 26, Twisted 26, over TCP or TLS): the application's ``send``
  is ``functools.partial(server.handle_reply, protocol)`` under Channels' wrappers; the
  queued bytes are Twisted's ``FileDescriptor`` buffers (``dataBuffer``/``offset``/
  ``_tempDataLen``), plus TLS's pre-handshake buffer one level up;
* **uvicorn** (0.54, ``websockets-sansio``, the default ``--ws``): ``send`` is the bound
  ``send`` of the protocol, whose asyncio transport reports its write buffer publicly;
* the Channels test communicator (an in-memory queue).

Where the OS offers it (Linux ``SIOCOUTQ``), the kernel's socket send queue (bytes not yet
acknowledged by the peer) is added, so that what the guard bounds is everything between
the application and the client: the server writes only while the total is under the
threshold, hence neither part can grow past threshold plus one frame.

Every attribute used here is pinned by the versions above; ``tests/test_backpressure.py``
runs real servers and breaks if they move. An unknown server raises
:class:`UnsupportedServer` instead of guessing.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import struct
import termios
from collections.abc import Callable
from typing import Any

from realtime_app.exceptions import RealtimeError

__all__ = ["Transport", "UnsupportedServer", "server_send", "text_frame", "transport_for"]

_SIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # same ioctl as SIOCOUTQ on Linux
_ZERO = b"\0\0\0\0"


class UnsupportedServer(RealtimeError):
    """The ASGI server of a connection is not one whose transport we know how to read."""

    def __init__(self, send: Any) -> None:
        super().__init__(send)
        self.send = send

    def __str__(self) -> str:
        return (
            f"cannot read the transport behind {self.send!r}: transport backpressure supports daphne and uvicorn "
            "(--ws websockets-sansio); set REALTIME_APP['MAX_BACKPRESSURE'] = 0 to run without the guard"
        )


def server_send(send: Callable[..., Any]) -> Callable[..., Any]:
    """The server's own ``send`` under Channels' middleware wrappers.

    ``SessionMiddleware`` (in ``AuthMiddlewareStack``) hands the application a bound
    ``send`` of a wrapper holding the server's as ``real_send``; unwrap every such layer.
    """
    for _ in range(10):
        inner = getattr(getattr(send, "__self__", None), "real_send", None)
        if inner is None:
            break
        send = inner
    return send


def _kernel_queue(fileno: int) -> int:
    """Bytes in the kernel's send queue of a socket (0 where the OS does not tell)."""
    if _SIOCOUTQ is None or fileno < 0:
        return 0
    try:
        return int(_unpack(fcntl.ioctl(fileno, _SIOCOUTQ, _ZERO))[0])
    except OSError:
        return 0


_unpack = struct.Struct("i").unpack
_LEN16 = struct.Struct("!BBH").pack
_LEN64 = struct.Struct("!BBQ").pack


def text_frame(payload: bytes) -> bytes:
    """One WebSocket text message, final, unmasked (RFC 6455 §5.2: a server never masks):
    the same bytes for every subscriber, so the hub builds it once per publication."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65536:
        return _LEN16(0x81, 126, n) + payload
    return _LEN64(0x81, 127, n) + payload


class Transport:
    """What the hub needs of one connection's transport. Writes are synchronous."""

    kind = "asgi"
    #: True when :meth:`buffered` reads real bytes (the guard can act on it).
    measurable = False

    def buffered(self) -> int:
        """Bytes accepted for this connection and not yet sent on the network."""
        return 0

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        """Queue one text message (UTF-8 ``payload``; ``frame``, when given, is
        :func:`text_frame` of it, for servers whose socket can take it as is); False if
        the connection is closing."""
        raise NotImplementedError

    def close(self, code: int, reason: str, drain_s: float) -> None:
        """Send a close frame with any valid ``code``; give the client ``drain_s`` seconds
        to read what is queued before the connection is dropped."""
        raise NotImplementedError

    def pause_reading(self, seconds: float) -> None:
        """Read nothing more from this client for ``seconds`` (TCP pushes back on it);
        no-op where the server offers no way. Writing goes on."""


class DaphneTransport(Transport):
    kind = "daphne"
    measurable = True

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        self._open = protocol.STATE_OPEN
        # Walk down to Twisted's TCP transport: through TLS when there is one.
        top = protocol.transport
        self.tls = top if hasattr(top, "_appSendBuffer") else None
        self.tcp = top.transport if self.tls is not None else top
        if self.tls is not None:
            self.kind = "daphne-tls"
        if not hasattr(self.tcp, "_tempDataLen"):
            raise UnsupportedServer(protocol)
        try:
            self.fileno = self.tcp.fileno()
        except Exception:
            self.fileno = -1
        self._direct: bool | None = None  # decided at the first write, once the handshake is done
        # Plain TCP: a frame may go to the socket at once while Twisted holds nothing for it.
        self.sock = getattr(self.tcp, "socket", None) if self.tls is None else None

    def buffered(self) -> int:
        tcp = self.tcp
        queued: int = len(tcp.dataBuffer) - tcp.offset + tcp._tempDataLen + _kernel_queue(self.fileno)
        if self.tls is not None and self.tls._appSendBuffer:
            queued += sum(len(b) for b in self.tls._appSendBuffer)
        return queued

    def _can_write_frames(self) -> bool:
        """True when autobahn would put exactly :func:`text_frame` on the wire: no
        per-message compression (daphne accepts none), no server masking, no automatic
        fragmentation, no timing tracker (autobahn 26)."""
        protocol = self.protocol
        return (
            getattr(protocol, "_perMessageCompress", True) is None
            and not getattr(protocol, "trackedTimings", True)
            and not getattr(protocol, "maskServerFrames", True)
            and not getattr(protocol, "autoFragmentSize", True)
            and not getattr(protocol, "logFrames", True)
            and not getattr(protocol, "logOctets", True)
            and hasattr(protocol, "send_queue")
        )

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        protocol = self.protocol
        if protocol.state != self._open:
            return False
        if frame is not None:
            direct = self._direct
            if direct is None:
                direct = self._direct = self._can_write_frames()
            limit = protocol.maxMessagePayloadSize
            if direct and not protocol.send_queue and not (0 < limit < len(payload)):
                # The frame built once per publication, straight to the socket's transport
                # (TLS included): autobahn's sendMessage would rebuild the same bytes per
                # connection and format a debug line it then discards.
                self._write_frame(frame)
                return True
        protocol.sendMessage(payload, False)
        return True

    def _write_frame(self, frame: bytes) -> None:
        """On plain TCP with nothing queued in Twisted, ``send()`` now (what asyncio's
        transports do) instead of registering the socket for writing and sending at the
        next turn of the loop: two ``epoll_ctl`` calls and a loop turn per frame and
        connection saved. What the socket does not take goes to Twisted's buffer, so
        bytes stay in order and the guard still sees them all."""
        tcp = self.tcp
        sock = self.sock
        if (
            sock is None
            or tcp._tempDataLen
            or len(tcp.dataBuffer) != tcp.offset
            or tcp.disconnecting
            or not tcp.connected
            or getattr(tcp, "_aborting", False)
            or getattr(tcp, "TLS", False)  # a connection upgraded with startTLS
        ):
            self.protocol.transport.write(frame)
            return
        try:
            sent = sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the connection is going: Twisted reports it (a reset as a plain close)
            tcp.write(frame)
            return
        if sent < len(frame):
            tcp.write(frame[sent:])

    def close(self, code: int, reason: str, drain_s: float) -> None:
        protocol = self.protocol
        if protocol.state != self._open:
            return
        # autobahn drops the connection closeHandshakeTimeout (1 s) after our close frame,
        # discarding what is queued before it: give a slow reader time to reach the frame.
        protocol.closeHandshakeTimeout = drain_s
        protocol.sendCloseFrame(code=int(code), reasonUtf8=reason.encode("utf-8")[:123] or None, isReply=False)

    def pause_reading(self, seconds: float) -> None:
        from twisted.internet import reactor

        tcp = self.tcp
        if getattr(self, "_paused", False) or self.protocol.state != self._open:
            return
        self._paused = True
        tcp.pauseProducing()

        def resume() -> None:
            self._paused = False
            if tcp.connected:
                tcp.resumeProducing()

        reactor_: Any = reactor
        reactor_.callLater(seconds, resume)


class UvicornTransport(Transport):
    kind = "uvicorn"
    measurable = True

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        self.transport = protocol.transport
        sock = self.transport.get_extra_info("socket")
        self.fileno = sock.fileno() if sock is not None else -1

    def buffered(self) -> int:
        return int(self.transport.get_write_buffer_size()) + _kernel_queue(self.fileno)

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        protocol = self.protocol
        if protocol.close_sent or self.transport.is_closing():
            return False
        # What uvicorn's own send does, minus ``await writable.wait()``: the guard, not
        # the transport's 64 KiB high-water mark, bounds what is queued.
        protocol.conn.send_text(payload)
        self.transport.write(b"".join(protocol.conn.data_to_send()))
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        protocol = self.protocol
        if protocol.close_sent or self.transport.is_closing():
            return
        protocol.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        protocol.conn.send_close(code, reason)
        self.transport.write(b"".join(protocol.conn.data_to_send()))
        protocol.close_sent = True
        if protocol.read_paused:
            protocol.read_paused = False
            self.transport.resume_reading()
        protocol.close_timer = protocol.loop.call_later(drain_s, self.transport.close)

    def pause_reading(self, seconds: float) -> None:
        transport = self.transport
        if getattr(self, "_paused", False) or transport.is_closing():
            return
        self._paused = True
        transport.pause_reading()

        def resume() -> None:
            self._paused = False
            if not transport.is_closing() and not self.protocol.read_paused:  # uvicorn's own pause wins
                transport.resume_reading()

        self.protocol.loop.call_later(seconds, resume)


class QueueTransport(Transport):
    """Channels' ``WebsocketCommunicator``: messages go to an in-memory queue."""

    kind = "memory"

    def __init__(self, send: Callable[..., Any]) -> None:
        self.put = send.__self__.put_nowait  # type: ignore[attr-defined]
        self.closed = False

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        if self.closed:
            return False
        self.put({"type": "websocket.send", "text": payload.decode("utf-8")})
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        if not self.closed:
            self.closed = True
            self.put({"type": "websocket.close", "code": int(code), "reason": reason})


class AsgiTransport(Transport):
    """Any other server: plain ASGI messages, nothing measured (the guard cannot run)."""

    def __init__(self, send: Callable[..., Any]) -> None:
        self.send = send
        self._tasks: set[asyncio.Task[Any]] = set()

    def _spawn(self, message: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self.send(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        self._spawn({"type": "websocket.send", "text": payload.decode("utf-8")})
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        self._spawn({"type": "websocket.close", "code": int(code), "reason": reason})


def _daphne_protocol(send: Callable[..., Any]) -> Any | None:
    if isinstance(send, functools.partial) and send.args:
        protocol = send.args[0]
        if hasattr(protocol, "sendCloseFrame") and hasattr(protocol, "handle_reply"):
            return protocol
    return None


def transport_for(send: Callable[..., Any], *, require_measurable: bool = False) -> Transport:
    """The adapter of the server behind ``send``.

    Raises :class:`UnsupportedServer` when ``require_measurable`` (the guard is on) and
    the server's queued bytes cannot be read.
    """
    raw = server_send(send)
    protocol = _daphne_protocol(raw)
    if protocol is not None:
        return DaphneTransport(protocol)
    owner = getattr(raw, "__self__", None)
    if isinstance(owner, asyncio.Queue):
        return QueueTransport(raw)
    if owner is not None and hasattr(owner, "conn") and hasattr(owner, "writable") and hasattr(owner, "transport"):
        return UvicornTransport(owner)
    if require_measurable:
        raise UnsupportedServer(raw)
    return AsgiTransport(send)
