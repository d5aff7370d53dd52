"""The uvicorn transport (0.54, ``--ws websockets-sansio``): ``send`` is the bound
``send`` of the protocol, whose asyncio transport reports its write buffer publicly; a
frame is written through the protocol's sans-I/O connection without awaiting uvicorn's
flow control (the guard, not its 64 KiB high-water mark, bounds what is queued)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from realtime_app.outbound.base import Transport, kernel_queue

__all__ = ["TESTED", "Counted", "UvicornHttpSink", "UvicornTransport", "untested", "uvicorn_cycle", "uvicorn_protocol"]

#: The series whose private names this module was tested against (the ``uvicorn`` extra bounds it).
TESTED = {"uvicorn": ("0.54",)}


def untested() -> list[str]:
    """``"uvicorn version"`` when the installed uvicorn is outside :data:`TESTED`."""
    try:
        version = metadata.version("uvicorn")
    except metadata.PackageNotFoundError:
        return []
    return [] if version.startswith(TESTED["uvicorn"]) else [f"uvicorn {version}"]


def uvicorn_protocol(owner: Any) -> bool:
    """True when ``owner`` (what the server's ``send`` is bound to) is uvicorn's sans-I/O protocol."""
    return owner is not None and hasattr(owner, "conn") and hasattr(owner, "writable") and hasattr(owner, "transport")


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
        protocol.conn.send_text(payload)
        self.counter.write(b"".join(protocol.conn.data_to_send()))
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
