"""The uvicorn transport (0.54, ``--ws websockets-sansio``): ``send`` is the bound
``send`` of the protocol, whose asyncio transport reports its write buffer publicly; a
frame is written without awaiting uvicorn's flow control (the guard, not its 64 KiB
high-water mark, bounds what is queued). Where the connection negotiated no extension
(no permessage-deflate), the publication's frame, built once, goes to the transport as
is; otherwise it goes through the protocol's sans-I/O connection, framed per connection.
uvicorn's other implementations (``--ws wsproto``, ``--ws websockets``) are not matched:
their queued bytes are not read (:class:`~realtime_app.outbound.base.UnsupportedServer`)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from realtime_app.conf.runtime import runtime
from realtime_app.outbound import input_queue
from realtime_app.outbound.base import Transport, kernel_queue

__all__ = [
    "TESTED",
    "Counted",
    "UvicornFence",
    "UvicornHttpSink",
    "UvicornTransport",
    "release_handshake",
    "untested",
    "uvicorn_cycle",
    "uvicorn_protocol",
]

#: The series whose private names this module was tested against (the ``uvicorn`` extra bounds it).
TESTED = {"uvicorn": ("0.54",)}


def untested() -> list[str]:
    """``"uvicorn version"`` when the installed uvicorn is outside :data:`TESTED`."""
    try:
        version = metadata.version("uvicorn")
    except metadata.PackageNotFoundError:
        return []
    return [] if version.startswith(TESTED["uvicorn"]) else [f"uvicorn {version}"]


class UvicornFence:
    """The version gate as read once per process (a part of the process's runtime)."""

    def __init__(self) -> None:
        self.tested = not untested()


def release_handshake(protocol: Any) -> None:
    """Let go of what the opening handshake left on an open socket: the request uvicorn
    keeps (websockets' parser holds it as well, so its headers are emptied) and the
    answer it sent (about 4 KiB, docs/performance.md), and lighten the input queue
    (:func:`~realtime_app.outbound.input_queue.lighten`). Tested series only; the scope
    the application holds is its own copy of the headers and stays."""
    if not runtime().part(UvicornFence).tested or not getattr(protocol, "handshake_complete", False):
        return
    if getattr(protocol, "initial_response", None) is None:  # an accepted socket, not a denial response
        request = getattr(protocol, "request", None)
        if request is not None:  # websockets' parser keeps it too, for the socket's life
            request.headers.clear()
        protocol.request = protocol.response = None
    input_queue.lighten(getattr(protocol, "queue", None))


def uvicorn_protocol(owner: Any) -> bool:
    """True when ``owner`` (what the server's ``send`` is bound to) is uvicorn's protocol
    over websockets' sans-I/O connection (``--ws websockets-sansio``); its wsproto
    implementation also has a ``conn``, but one this module cannot drive."""
    if owner is None or not (hasattr(owner, "writable") and hasattr(owner, "transport")):
        return False
    conn = getattr(owner, "conn", None)
    return hasattr(conn, "data_to_send") and hasattr(conn, "send_text") and hasattr(conn, "extensions")


class Counted:
    """The connection's transport as uvicorn's protocol sees it: every write counted
    (uvicorn's pings, pongs, close frames and binary messages too, on asyncio's loop or
    uvloop's), everything else the transport's own."""

    __slots__ = ("kernel", "real", "since")

    def __init__(self, real: Any) -> None:
        self.real = real
        self.since = 0  # bytes written since the guard last read the queues
        self.kernel = 0  # bytes queued then (asyncio's and the kernel's)

    def write(self, data: bytes) -> None:
        self.since += len(data)
        self.real.write(data)

    def writelines(self, chunks: Any) -> None:
        chunks = list(chunks)
        self.since += sum(len(c) for c in chunks)
        self.real.writelines(chunks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class UvicornTransport(Transport):
    kind = "uvicorn"
    measurable = True

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        counted = protocol.transport
        if not isinstance(counted, Counted):  # every write of the connection counted from now on
            counted = protocol.transport = Counted(counted)
        self.counter = counted  # what is written through
        self.transport = counted.real  # what is read
        sock = self.transport.get_extra_info("socket")
        self.fileno = sock.fileno() if sock is not None else -1
        # uvicorn's own TLS: what its SSL layer handed the TCP transport is in no buffer
        # the guard reads, and the wire carries more than the counted plaintext: read always.
        self.exact = self.transport.get_extra_info("sslcontext") is not None
        self.open = type(protocol.conn.state).OPEN
        self.fresh = True  # the handshake's leftovers are let go at the first frame

    def buffered(self) -> int:
        held = int(self.transport.get_write_buffer_size())
        queued = held + kernel_queue(self.fileno)
        self.counter.since, self.counter.kernel = 0, queued  # what asyncio holds reaches the kernel uncounted
        return queued

    def queued(self, under: int) -> int:
        """0 without a syscall while what was written since the queues were read plus
        what was queued then is at most ``under`` and the loop holds nothing: the kernel
        cannot hold more."""
        counter = self.counter
        if not self.exact and counter.since + counter.kernel <= under and not self.transport.get_write_buffer_size():
            return 0
        return self.buffered()

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        protocol = self.protocol
        if protocol.close_sent or self.transport.is_closing():
            return False
        # What uvicorn's own send does, minus ``await writable.wait()``: the guard, not
        # the transport's 64 KiB high-water mark, bounds what is queued.
        conn = protocol.conn
        if conn.state is not self.open:
            return False
        if self.fresh:
            self.fresh = False
            release_handshake(protocol)
        if frame is not None and not conn.extensions and not conn.expect_continuation_frame:
            # No extension negotiated: conn.send_text would frame exactly this, built once.
            self.counter.write(frame)
            return True
        conn.send_text(payload)
        self.counter.write(b"".join(conn.data_to_send()))
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        protocol = self.protocol
        if protocol.close_sent or self.transport.is_closing():
            return
        protocol.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        protocol.conn.send_close(code, reason)
        self.counter.write(b"".join(protocol.conn.data_to_send()))
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


def uvicorn_cycle(owner: Any) -> bool:
    """True when ``owner`` is uvicorn's HTTP request-response cycle (httptools or h11)."""
    return (
        owner is not None
        and hasattr(owner, "transport")
        and hasattr(owner, "flow")
        and hasattr(owner, "response_complete")
        and (hasattr(owner, "chunked_encoding") or hasattr(owner, "conn"))  # httptools, h11
    )


class UvicornHttpSink:
    """The body of one streamed HTTP response under uvicorn: framed as its own ``send``
    frames it (chunked, or through h11), written without awaiting its flow control."""

    kind = "uvicorn"
    measurable = True

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        self.transport = cycle.transport
        sock = self.transport.get_extra_info("socket")
        self.fileno = sock.fileno() if sock is not None else -1
        self.h11 = getattr(cycle, "conn", None)  # the h11 implementation's state machine

    def buffered(self) -> int:
        return int(self.transport.get_write_buffer_size()) + kernel_queue(self.fileno)

    def write(self, data: bytes, chunk: bytes | None = None) -> bool:
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete or self.transport.is_closing():
            return False
        if self.h11 is not None:
            import h11

            self.transport.write(self.h11.send(h11.Data(data=data)))
        elif cycle.chunked_encoding:
            self.transport.write(chunk or b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self.transport.write(data)
        return True

    def abort(self) -> None:
        self.transport.abort()

    def pause_reading(self, seconds: float) -> None:
        pass  # a stream reads nothing after its request
