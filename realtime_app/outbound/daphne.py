"""The daphne transport: the only module that reads daphne's, autobahn's and Twisted's
private names, behind one version gate.

The application's ``send`` is ``functools.partial(server.handle_reply, protocol)`` under
Channels' wrappers; the queued bytes are Twisted's ``FileDescriptor`` buffers
(``dataBuffer``/``offset``/``_tempDataLen``), plus TLS's pre-handshake buffer one level
up. With the tested series (:data:`TESTED`) a frame built once per publication goes
straight to the socket (:class:`SendAtOnce`, docs/performance.md says
what it saves); with any other version that path is off — frames go through autobahn's
public ``sendPreparedMessage`` — and a warning says so once (check ``W020`` says it at
``manage.py check``). The buffers are read on every version that still has them;
one that does not is refused as :class:`UnsupportedServer`, never guessed at.
"""

from __future__ import annotations

import collections
import functools
import logging
import weakref
from importlib import metadata
from typing import Any

from realtime_app.conf.runtime import runtime
from realtime_app.outbound import input_queue
from realtime_app.outbound.base import Transport, UnsupportedServer, kernel_queue
from realtime_app.wire.asgi import Send

__all__ = [
    "TESTED",
    "DaphneFence",
    "DaphneHttpSink",
    "DaphneTransport",
    "daphne_protocol",
    "daphne_request",
    "internals_tested",
    "release_handshake",
    "SendAtOnce",
    "SendQueue",
    "compact",
    "send_at_once",
    "untested",
]

logger = logging.getLogger("realtime_app.backpressure")

#: The series whose private names this module was tested against (pyproject.toml bounds them).
TESTED = {"daphne": ("4.2",), "autobahn": ("26.",), "twisted": ("26.",)}


class DaphneFence:
    """The version gate as read (once per process) and the publication last prepared
    through autobahn's public API (a part of the process's runtime)."""

    def __init__(self) -> None:
        self.tested: bool | None = None
        self.last: tuple[bytes, Any] | None = None  # the frame being fanned out, prepared
        #: Per factory (held weakly), per protocol class: the subclass holding what every
        #: open socket of that factory holds alike (:func:`compact`).
        self.lean: weakref.WeakKeyDictionary[Any, dict[type, type]] = weakref.WeakKeyDictionary()


def untested() -> list[str]:
    """``"package version"`` of each installed package outside :data:`TESTED`."""
    out = []
    for package, prefixes in TESTED.items():
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if not version.startswith(prefixes):
            out.append(f"{package} {version}")
    return out


def internals_tested() -> bool:
    """The version gate, read once per process; logged once when it is shut."""
    fence = runtime().part(DaphneFence)
    if fence.tested is None:
        found = untested()
        fence.tested = not found
        if found:
            logger.warning(
                "%s: not the series realtime_app was tested with; frames go through autobahn's "
                "public API (slower), queued bytes are still read (check realtime_app.W020)",
                ", ".join(found),
            )
    return fence.tested


def daphne_protocol(send: Send) -> Any | None:
    """daphne's protocol of a connection, from the server's ``send``; None for another server."""
    if isinstance(send, functools.partial) and send.args:
        protocol = send.args[0]
        if hasattr(protocol, "sendCloseFrame") and hasattr(protocol, "handle_reply"):
            return protocol
    return None


def _twisted_holds(tcp: Any) -> bool:
    """Twisted must take this write: it holds bytes for the connection (order), or the
    connection is going or was upgraded to TLS."""
    return bool(
        tcp._tempDataLen
        or len(tcp.dataBuffer) != tcp.offset
        or tcp.disconnecting
        or not tcp.connected
        or tcp._writeDisconnected
        or getattr(tcp, "_aborting", False)
        or getattr(tcp, "TLS", False)  # a connection upgraded with startTLS
    )


class SendAtOnce:
    """Every write of one plain-TCP connection (fanned-out frames, autobahn's pings,
    replies and close frames): ``send()`` now while Twisted holds nothing for it, as
    asyncio's transports do, instead of registering the socket for writing and sending
    at the next turn of the loop — two ``epoll_ctl`` calls and a loop turn per write
    saved. What the socket does not take goes to Twisted's own ``write``, so bytes stay
    in order and the guard still sees them all.

    It counts what it hands the kernel (``since``) and whether Twisted took anything
    (``spilled``) since the guard last read the kernel's queue (``kernel``, then): while
    their sum is small, the kernel holds at most it and the guard need not ask
    (:meth:`DaphneTransport.queued`). It holds its connection weakly: installed as the
    connection's ``write``, a strong reference would be a cycle that keeps a closed
    connection and its unsent buffers until a full collection.
    """

    __slots__ = ("bound", "kernel", "own", "ref", "since", "sock", "spilled")

    def __init__(self, tcp: Any) -> None:
        self.ref = weakref.ref(tcp)
        self.sock = tcp.socket
        own = tcp.write  # Twisted's
        self.bound = getattr(own, "__self__", None) is tcp
        self.own = own.__func__ if self.bound else own  # called with the connection when it was its method
        self.since = 0
        self.kernel = 0
        self.spilled = False

    def _twisted(self, tcp: Any, data: bytes) -> None:
        self.spilled = True
        if self.bound:
            self.own(tcp, data)
        else:
            self.own(data)

    def __call__(self, data: bytes) -> None:
        tcp = self.ref()
        if tcp is None:  # the connection is gone: nothing to write to
            return
        if _twisted_holds(tcp):
            self._twisted(tcp, data)
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the connection is going: Twisted reports it (a reset as a plain close)
            self._twisted(tcp, data)
            return
        self.since += sent
        if sent < len(data):
            self._twisted(tcp, data[sent:])


def send_at_once(tcp: Any) -> SendAtOnce:
    """The connection's :class:`SendAtOnce`, installed as its ``write`` on first use."""
    writer = tcp.write
    if not isinstance(writer, SendAtOnce):
        writer = tcp.write = SendAtOnce(tcp)
    return writer


def daphne_request(send: Send) -> Any | None:
    """daphne's HTTP/1.x request of a response being streamed, from the server's ``send``
    (None for another server, HTTP/2, or a request whose client is gone)."""
    if isinstance(send, functools.partial) and send.args:
        request = send.args[0]
        channel = getattr(request, "channel", None)
        if hasattr(request, "handle_reply") and not hasattr(request, "sendCloseFrame") and channel is not None:
            return request if getattr(channel, "transport", None) is not None else None
    return None


def _layers(top: Any) -> tuple[Any, Any]:
    """(TLS layer or None, Twisted's TCP transport) under a protocol's ``transport``."""
    tls = top if hasattr(top, "_appSendBuffer") else None
    tcp = top.transport if tls is not None else top
    if not hasattr(tcp, "_tempDataLen"):
        raise UnsupportedServer(top)
    return tls, tcp


def _queued(tls: Any, tcp: Any, fileno: int) -> int:
    """Bytes Twisted holds for a connection (TLS's pre-handshake buffer included) and
    the kernel's send queue."""
    queued: int = len(tcp.dataBuffer) - tcp.offset + tcp._tempDataLen + kernel_queue(fileno)
    if tls is not None and tls._appSendBuffer:
        queued += sum(len(b) for b in tls._appSendBuffer)
    return queued


def _fileno(tcp: Any) -> int:
    try:
        return int(tcp.fileno())
    except Exception:
        return -1


class DaphneHttpSink:
    """The body of one streamed HTTP response under daphne: written with daphne's own
    ``handle_reply`` (synchronous, what the ASGI ``send`` does), its bytes read where
    the socket's are."""

    measurable = True

    def __init__(self, request: Any) -> None:
        self.request = request
        self.top = request.channel.transport
        self.tls, self.tcp = _layers(self.top)
        self.kind = "daphne-tls" if self.tls is not None else "daphne"
        self.fileno = _fileno(self.tcp)
        plain = self.tls is None and getattr(self.tcp, "socket", None) is not None
        # HTTP/1.1 over Twisted's HTTPChannel: its body bytes are the transport's, in order
        direct = request.clientproto == b"HTTP/1.1" and hasattr(request.channel, "writeSequence")
        self.writer = send_at_once(self.tcp) if plain and direct and internals_tested() else None
        if hasattr(request.channel, "persistent"):
            request.channel.persistent = False  # the stream's connection ends with it (Connection: close)

    def buffered(self) -> int:
        return _queued(self.tls, self.tcp, self.fileno)

    def write(self, data: bytes, chunk: bytes | None = None) -> bool:
        """``data`` as the body's next bytes; ``chunk``, when given, is it framed as an
        HTTP/1.1 chunk (built once per publication for every stream with the same id)."""
        request = self.request
        if request.finished or request.channel is None:
            return False
        if request.chunked and request.startedWriting and self.writer is not None:
            # What Request.write does for a chunked body, minus Twisted's buffer and the
            # next turn of the reactor: the chunk to the socket now (as a frame is).
            request.sentLength += len(data)
            self.writer(chunk or b"%x\r\n%b\r\n" % (len(data), data))
            return True
        request.handle_reply({"type": "http.response.body", "body": data, "more_body": True})
        return True

    def abort(self) -> None:
        if self.tcp.connected:
            self.tcp.abortConnection()

    def pause_reading(self, seconds: float) -> None:
        pass  # a stream reads nothing after its request


def _prepared(factory: Any, payload: bytes, frame: bytes) -> Any:
    """autobahn's public ``PreparedMessage`` of a publication, built once for all of this
    process's connections (the hub hands every subscriber the same ``frame`` object)."""
    fence = runtime().part(DaphneFence)
    if fence.last is None or fence.last[0] is not frame:
        fence.last = (frame, factory.prepareMessage(payload))
    return fence.last[1]


#: What autobahn keeps of the opening handshake and never reads once the socket is open
#: (autobahn 26: read only in ``processHandshake``/``succeedHandshake``).
_HANDSHAKE_ONLY = (
    "http_request_data",
    "http_response_data",
    "http_status_line",
    "http_request_uri",
    "http_request_host",
    "http_request_params",
    "http_headers",
    "websocket_protocols",
    "websocket_extensions",
)


class _Path:
    """What daphne reads of the handshake's request once the socket is open: its path
    (its access log at close and reject)."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


def release_handshake(protocol: Any, tcp: Any) -> None:
    """Let go of what the opening handshake left behind on an open socket — about a
    quarter of a connection's Python heap (docs/performance.md): the HTTP request daphne
    upgraded (Twisted's ``HTTPChannel`` stays the TCP transport's producer and keeps the
    request, its headers and its body for the socket's life; its pause and resume do
    nothing after the upgrade), and autobahn's copies of the request's bytes and headers
    and of its answer. Tested series only (the caller checks the gate)."""
    from twisted.web.http import HTTPChannel

    channel = getattr(tcp, "producer", None)
    if isinstance(channel, HTTPChannel) and getattr(tcp, "protocol", None) is not channel:  # handed over
        channel.requests = []
        tcp.unregisterProducer()
    request = getattr(protocol, "request", None)
    if request is not None and not isinstance(request, _Path):
        protocol.request = _Path(request.path)
    for name in _HANDSHAKE_ONLY:
        if name in vars(protocol):
            setattr(protocol, name, None)
    input_queue.lighten(getattr(protocol, "application_queue", None))
    compact(protocol)


def compact(protocol: Any) -> None:
    """Rebuild an open socket's attribute dict without what every socket of its factory
    holds alike: autobahn copies the factory's 29 options onto each protocol
    (``CONFIG_ATTRS``), which with the handshake's names takes the dict past 85 keys — a
    3.2 KiB table where 1.5 KiB hold the rest. Those values move to one subclass per
    factory (the same class name, module and interfaces); a value a socket holds of its own
    stays in its dict; its empty send queue becomes a :class:`SendQueue`. Tested series
    only (the caller checks the gate)."""
    cls, factory = type(protocol), getattr(protocol, "factory", None)
    names = getattr(cls, "CONFIG_ATTRS", None)
    if factory is None or not names:
        return
    if "_lean" in cls.__dict__:
        return  # already lean
    classes = runtime().part(DaphneFence).lean.setdefault(factory, {})
    sub = classes.get(cls)
    if sub is None:
        shared = {name: getattr(factory, name) for name in names if hasattr(factory, name)}
        shared.update(dict.fromkeys(_HANDSHAKE_ONLY), _lean=True, __module__=cls.__module__)
        shared["__qualname__"] = cls.__qualname__
        sub = classes[cls] = type(cls.__name__, (cls,), shared)
    own = vars(protocol)
    kept = {name: value for name, value in own.items() if name not in sub.__dict__ or value is not sub.__dict__[name]}
    if type(kept.get("send_queue")) is collections.deque and not kept["send_queue"]:
        kept["send_queue"] = SendQueue()  # 760 bytes of deque for sends daphne never chops
    protocol.__class__ = sub
    protocol.__dict__ = kept


class SendQueue:
    """autobahn's queue of chopped or synced sends (daphne makes none): empty, it holds
    no deque; the first send it queues makes one."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: collections.deque[Any] | None = None

    def __len__(self) -> int:
        return len(self.items) if self.items is not None else 0

    def append(self, item: Any) -> None:
        if self.items is None:
            self.items = collections.deque()
        self.items.append(item)

    def popleft(self) -> Any:
        if self.items is None:
            raise IndexError("pop from an empty deque")
        return self.items.popleft()


class DaphneTransport(Transport):
    kind = "daphne"
    measurable = True
    #: How a frame built once per publication is written: ``"direct"`` — to the socket
    #: (tested versions only, else as ``"prepared"``); ``"prepared"`` — autobahn's public
    #: ``sendPreparedMessage``; ``"message"`` — ``sendMessage``, framed again per
    #: connection. ``bench/fanout.py --daphne-write`` measures the three side by side.
    write_mode = "direct"

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        self._open = protocol.STATE_OPEN
        # Walk down to Twisted's TCP transport: through TLS when there is one.
        try:
            self.tls, self.tcp = _layers(protocol.transport)
        except UnsupportedServer:
            raise UnsupportedServer(protocol) from None
        if self.tls is not None:
            self.kind = "daphne-tls"
        self.fileno = _fileno(self.tcp)
        self._direct: bool | None = None  # decided at the first write, once the handshake is done
        self._tested = self.write_mode == "direct" and internals_tested()  # the gate, read once
        # Plain TCP: every write goes to the socket at once while Twisted holds nothing for it.
        plain = self.tls is None and getattr(self.tcp, "socket", None) is not None
        self.writer = send_at_once(self.tcp) if plain and self._tested else None

    def buffered(self) -> int:
        queued = _queued(self.tls, self.tcp, self.fileno)
        writer = self.writer
        if writer is not None:
            held = len(self.tcp.dataBuffer) - self.tcp.offset + self.tcp._tempDataLen
            writer.since, writer.spilled, writer.kernel = 0, bool(held), queued - held
        return queued

    def queued(self, under: int) -> int:
        """0 without a syscall while all this connection's writes went to the kernel at
        once and they and what it held when last read add up to at most ``under`` (the
        kernel cannot hold more), and Twisted holds nothing; else :meth:`buffered`, read."""
        writer, tcp = self.writer, self.tcp
        if (
            writer is not None
            and not writer.spilled
            and writer.since + writer.kernel <= under
            and not tcp._tempDataLen  # writeSequence writes there without our write
            and len(tcp.dataBuffer) == tcp.offset
        ):
            return 0
        return self.buffered()

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
        if frame is not None and self.write_mode != "message" and self._frame_as_is(payload):
            if self._tested:
                # The frame built once per publication, straight to the socket's transport
                # (TLS included): autobahn's sendMessage would rebuild the same bytes per
                # connection and format a debug line it then discards.
                (self.writer or protocol.transport.write)(frame)
            else:
                protocol.sendPreparedMessage(_prepared(protocol.factory, payload, frame))
            return True
        protocol.sendMessage(payload, False)
        return True

    def _frame_as_is(self, payload: bytes) -> bool:
        """The frame built once is what autobahn would write for this connection now
        (nothing queued in it, within its size limit); else ``sendMessage`` frames it."""
        direct = self._direct
        if direct is None:
            direct = self._direct = self._can_write_frames()
            if self._tested and self.tls is None:  # the socket is open: its first frame
                release_handshake(self.protocol, self.tcp)
        limit = self.protocol.maxMessagePayloadSize
        return direct and not self.protocol.send_queue and not (0 < limit < len(payload))

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
