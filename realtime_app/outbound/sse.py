"""A Server-Sent Events response as a connection's transport.

The hub writes a publication to every subscriber as the JSON-RPC ``message``
notification it builds once; :class:`EventStream` turns it into one event,
``event: <channel>`` / ``id: <positions>`` / ``data: <params>`` (the event's body is
built once per publication, as the WebSocket frame is: only the ``id`` line is the
stream's own). The ``id`` is the stream's place on every channel with history,
``{"channel": [seq, "epoch"], ...}``: a reconnect sends it back as ``Last-Event-ID``
and gets what it missed, once, in order (:func:`parse_positions`).

What a socket would get as a gap or a close is said in the stream itself:

* a channel's history could not fill a gap, or was replaced: ``event: realtime.resync``
  with ``{"channel", "epoch", "seq", "reason"}``, before the next frame;
* a frame of a channel with history was dropped by the guard (the client reads too
  slowly): the stream ends, so that the client's reconnect resumes where it was;
* the stream is closed (backpressure, logout, revoked rights, a drain): a final
  ``event: realtime.close`` with ``{"code", "reason"}`` (the WebSocket close codes).

Bytes go to a :class:`Sink`: the server's own HTTP transport under daphne and uvicorn
(:mod:`.daphne`, :mod:`.uvicorn`: the bytes queued are read as for a socket, so the guard
bounds a stream as it bounds a socket), an in-memory queue under the Channels test
communicator, plain ASGI messages elsewhere (nothing measured).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from typing import Any, Protocol

from realtime_app.conf.runtime import runtime
from realtime_app.outbound.base import Transport, UnsupportedServer, server_send
from realtime_app.wire.asgi import Send
from realtime_app.wire.history import newer_epoch

__all__ = [
    "CLOSE_EVENT",
    "RESYNC_EVENT",
    "EventStream",
    "Sink",
    "parse_positions",
    "sink_for",
]

CLOSE_EVENT = "realtime.close"
RESYNC_EVENT = "realtime.resync"
#: Frames a settling channel holds at most until its subscribe answers.
MAX_HELD_FRAMES = 1000
#: Events (with their ``id``) kept built per publication: streams at the same place share one.
MAX_IDS_KEPT = 16
#: ``Last-Event-ID`` read at most this long (a stream's positions on its channels).
MAX_LAST_EVENT_ID = 16 * 1024

Positions = dict[str, tuple[str, int]]  # channel -> (epoch, seq)

_MESSAGE = b'{"jsonrpc":"2.0","method":"message","params":'
_TAIL = re.compile(rb',"seq":(\d+)(?:,"epoch":"([0-9A-Za-z_.-]*)")?,"ts":\d+\}$')
_decode = json.JSONDecoder().raw_decode


class Sink(Protocol):
    """Where a stream's bytes go: the response body of one HTTP request."""

    kind: str
    measurable: bool

    def buffered(self) -> int: ...
    def write(self, data: bytes, chunk: bytes | None = None) -> bool: ...
    def abort(self) -> None: ...
    def pause_reading(self, seconds: float) -> None: ...


class Publication:
    """One ``message`` notification read once for every stream: its channel, its
    position (channels with history) and its event without the ``id`` line."""

    __slots__ = ("body", "channel", "epoch", "events", "seq")

    def __init__(self, payload: bytes) -> None:
        params = payload[len(_MESSAGE) : -1]
        text = params.decode("utf-8")
        channel, _ = _decode(text, text.index(":") + 1)
        self.channel: str = channel
        tail = _TAIL.search(params)
        self.seq = int(tail.group(1)) if tail else 0
        self.epoch = tail.group(2).decode("ascii") if tail and tail.group(2) is not None else None
        self.body = b"event: " + _line(channel) + b"\ndata: " + params + b"\n\n"
        self.events: dict[bytes, tuple[bytes, bytes]] = {}  # id -> (event, its HTTP/1.1 chunk)

    def event(self, event_id: bytes) -> tuple[bytes, bytes]:
        """The event with ``event_id`` and its chunk: built once for every stream at the
        same place (every stream of a ticker, every stream of one channel's history)."""
        built = self.events.get(event_id)
        if built is None:
            data = b"id: " + event_id + b"\n" + self.body
            built = (data, b"%x\r\n%b\r\n" % (len(data), data))
            if len(self.events) < MAX_IDS_KEPT:
                self.events[event_id] = built
        return built


class LastPublication:
    """The payload last read and its :class:`Publication` (a part of the process's runtime):
    every stream of a publication reads it once."""

    def __init__(self) -> None:
        self.payload: bytes | None = None
        self.publication: Publication | None = None


def publication(payload: bytes) -> Publication:
    last = runtime().part(LastPublication)
    if last.payload is not payload or last.publication is None:
        last.payload, last.publication = payload, Publication(payload)
    return last.publication


def _line(text: str) -> bytes:
    """``text`` as one line of an event (what could end the line is escaped)."""
    return text.replace("\r", "\\r").replace("\n", "\\n").encode("utf-8", "surrogatepass")


def event(name: str, data: Any, event_id: bytes | None = None) -> bytes:
    """One event named ``name`` with ``data`` as JSON (no newline: JSON escapes them)."""
    head = b"id: " + event_id + b"\n" if event_id is not None else b""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return head + b"event: " + _line(name) + b"\ndata: " + body + b"\n\n"


def encode_positions(positions: Positions) -> bytes:
    """The ``id`` of a stream at ``positions`` (``-``: nothing to resume from)."""
    if not positions:
        return b"-"
    data = {channel: [seq, epoch] for channel, (epoch, seq) in positions.items()}
    return json.dumps(data, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def parse_positions(text: str | None) -> Positions:
    """A ``Last-Event-ID`` back into positions; what is not one of ours reads as none."""
    if not text or text == "-" or len(text) > MAX_LAST_EVENT_ID:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: none of ours
        return {}
    if not isinstance(data, dict):
        return {}
    out: Positions = {}
    for channel, value in data.items():
        if (
            isinstance(value, list)
            and len(value) == 2
            and isinstance(value[0], int)
            and not isinstance(value[0], bool)
            and 0 <= value[0] < 2**53
            and isinstance(value[1], str)
            and 0 < len(value[1]) <= 64
        ):
            out[channel] = (value[1], value[0])
    return out


class EventStream(Transport):
    """One SSE response as the hub sees a connection's transport.

    ``positions``: where the client says it is (its ``Last-Event-ID``); channels being
    subscribed are settling (:meth:`settling`, :meth:`settled`) until their subscribe
    answered: a jump there is history that could not fill the gap (a resync event), a
    jump elsewhere a frame lost on the way (the stream ends: the client's reconnect
    resumes it). A frame a settling channel cannot place yet (the client said it was
    further than the history is) waits for the answer."""

    def __init__(
        self,
        sink: Sink,
        positions: Positions | None = None,
        drain_s: float = 10.0,
        ended: asyncio.Future[None] | None = None,
    ) -> None:
        self.sink = sink
        self.kind = f"sse-{sink.kind}"
        self.measurable = sink.measurable
        self.positions: Positions = dict(positions or {})
        self._settling: dict[str, tuple[str, int] | None] = {}  # channel -> its position when it began
        self._held: dict[str, list[bytes]] = {}  # frames of a settling channel not placed yet
        self._id = encode_positions(self.positions)
        self.started = False  # the response's head is sent: bytes may follow
        self.closed = False
        self.final: tuple[int, str] | None = None  # the close's (code, reason)
        self.ended = ended  # set when the stream closes (its consumer waits on it)
        self.drain_s = drain_s  # CLOSE_DRAIN_MS: what a close of its own gives the client
        self.events = 0

    def keep_only(self, channels: set[str]) -> None:
        """Forget the positions of channels this stream does not carry: its ``id`` names
        its own channels only (an id a client sends back never grows)."""
        self.positions = {c: at for c, at in self.positions.items() if c in channels}
        self._id = encode_positions(self.positions)

    def open(self, retry_ms: int) -> None:
        """The response's head was sent: the stream starts with the client's ``retry``."""
        self.started = True
        self.sink.write(b"retry: %d\n\n" % retry_ms)

    def buffered(self) -> int:
        return self.sink.buffered()

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        if self.closed or not self.started:
            return False
        if not payload.startswith(_MESSAGE):
            return self._notice(payload)
        pub = publication(payload)
        if pub.epoch is not None and not self._advance(pub.channel, pub.epoch, pub.seq, payload):
            return not self.closed
        self.events += 1
        return self._put(*pub.event(self._id))

    def _put(self, data: bytes, chunk: bytes | None = None) -> bool:
        """Write to the sink; a sink that takes nothing more (its connection is gone, and
        the server may never say so: uvicorn tells only the last request of a pipelined
        connection) ends the stream, so that its connection is released."""
        if self.sink.write(data, chunk):
            return True
        self.lost()
        return False

    def lost(self) -> None:
        """The client's connection is gone: the stream ends without a final event."""
        if not self.closed:
            self.closed = True
            if self.ended is not None and not self.ended.done():
                self.ended.set_result(None)

    def dropped(self, payload: bytes) -> None:
        """A frame of a channel with history dropped: the stream ends now (the client's
        reconnect resumes from the last ``id`` it read), not at the next frame written."""
        if not self.closed and payload.startswith(_MESSAGE) and publication(payload).epoch is not None:
            self.close(1013, "backpressure", self.drain_s)

    def _advance(self, channel: str, epoch: str, seq: int, payload: bytes) -> bool:
        """Move the stream's position on ``channel``; False when the frame is not sent."""
        at = self.positions.get(channel)
        if at is not None:
            if epoch == at[0]:
                if seq <= at[1]:
                    return self._hold(channel, at, payload)  # had it already, or the client was ahead
                if seq > at[1] + 1:
                    if channel not in self._settling:  # lost on the way: the reconnect resumes it
                        self.close(1013, "gap", self.drain_s)
                        return False
                    self.resync(channel, epoch, seq - 1, "too_old")
            elif newer_epoch(epoch, at[0]):
                self.resync(channel, epoch, seq - 1, "epoch_changed")
            else:
                return self._hold(channel, at, payload)  # a late frame of a replaced history, or ahead
        self.positions[channel] = (epoch, seq)
        self._id = encode_positions(self.positions)
        return True

    def _hold(self, channel: str, at: tuple[str, int], payload: bytes) -> bool:
        """Keep a frame the client's own position refuses while its subscribe is settling:
        the answer may say that position is not the history's (then it is placed)."""
        if channel in self._settling and self._settling[channel] == at:
            held = self._held.setdefault(channel, [])
            if len(held) < MAX_HELD_FRAMES:
                held.append(payload)
        return False

    def settling(self, channel: str) -> None:
        """``channel`` is being subscribed (or resumed): its first frames may jump."""
        self._settling[channel] = self.positions.get(channel)

    def settled(self, channel: str, answer: dict[str, Any]) -> list[bytes]:
        """``channel``'s subscribe answered ``answer``: a resume that failed is said as a
        resync and the position moves to the history's; returns the frames held meanwhile,
        to send (through the connection's guard) once the answer is out."""
        began = self._settling.pop(channel, None)
        held = self._held.pop(channel, [])
        epoch, top = answer.get("epoch"), answer.get("seq")
        if not isinstance(epoch, str) or not isinstance(top, int):
            return held
        at = self.positions.get(channel)
        failed = answer.get("recovered") is False
        if at == began:  # nothing placed since it began: the answer says where the stream is
            if at is not None and failed:
                self.resync(channel, epoch, top, str(answer.get("reason", "too_old")))
            self.positions[channel] = (epoch, top)
        elif at is not None and failed and (at[0] == epoch and at[1] < top or newer_epoch(epoch, at[0])):
            self.resync(channel, epoch, top, str(answer.get("reason", "too_old")))
            self.positions[channel] = (epoch, top)
        self._id = encode_positions(self.positions)
        return held

    def resync(self, channel: str, epoch: str, seq: int, reason: str) -> None:
        """Tell the client its state of ``channel`` cannot be caught up: reload it."""
        self.positions[channel] = (epoch, seq)
        self._id = encode_positions(self.positions)
        data = {"channel": channel, "epoch": epoch, "seq": seq, "reason": reason}
        self._put(event(RESYNC_EVENT, data, self._id))

    def send_event(self, name: str, data: Any) -> bool:
        """A control event of this stream (the subscribe answers, an error), with the
        stream's ``id``: a client that reconnects right after it resumes from there."""
        return self.started and not self.closed and self._put(event(name, data, self._id))

    def comment(self) -> bool:
        """A heartbeat: a comment line, which keeps proxies and the client's timer quiet."""
        return self.started and not self.closed and self._put(b":\n\n")

    def _notice(self, payload: bytes) -> bool:
        """Another notification (``token_expiring``, ``presence``): ``realtime.<method>``."""
        try:
            message = json.loads(payload)
        except ValueError:
            return True
        method = message.get("method") if isinstance(message, dict) else None
        if not isinstance(method, str):
            return True  # a response: nothing asks over a stream
        return self._put(event(f"realtime.{method}", message.get("params")))

    def close(self, code: int, reason: str, drain_s: float) -> None:
        """The final event, then the end of the response (the consumer writes it: it owns
        the ASGI ``send``); what is queued gets ``drain_s`` to reach the client."""
        if self.closed:
            return
        self.closed = True
        self.final = (int(code), reason)
        self.drain_s = drain_s
        try:
            if self.started:
                self.sink.write(event(CLOSE_EVENT, {"code": int(code), "reason": reason}))
        finally:
            if self.ended is not None and not self.ended.done():
                self.ended.set_result(None)

    def pause_reading(self, seconds: float) -> None:
        self.sink.pause_reading(seconds)


class QueueSink:
    """Channels' ``ApplicationCommunicator``: body messages go to its queue."""

    kind = "memory"
    measurable = False

    def __init__(self, send: Any) -> None:
        self.put = send.__self__.put_nowait

    def buffered(self) -> int:
        return 0

    def write(self, data: bytes, chunk: bytes | None = None) -> bool:
        self.put({"type": "http.response.body", "body": data, "more_body": True})
        return True

    def abort(self) -> None:
        pass

    def pause_reading(self, seconds: float) -> None:
        pass


class AsgiSink:
    """Any other server: body messages through ASGI, in order, nothing measured."""

    kind = "asgi"
    measurable = False

    def __init__(self, send: Send) -> None:
        self.send = send
        self.queue: deque[bytes] = deque()
        self.task: asyncio.Task[None] | None = None

    def buffered(self) -> int:
        return sum(len(b) for b in self.queue)

    def write(self, data: bytes, chunk: bytes | None = None) -> bool:
        self.queue.append(data)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._pump())
        return True

    async def _pump(self) -> None:
        while self.queue:
            await self.send({"type": "http.response.body", "body": self.queue.popleft(), "more_body": True})

    async def drained(self) -> None:
        """Until what was written is sent (the end of the body must come after it)."""
        while self.task is not None and not self.task.done():
            await asyncio.shield(self.task)

    def abort(self) -> None:
        self.queue.clear()
        if self.task is not None:
            self.task.cancel()

    def pause_reading(self, seconds: float) -> None:
        pass


def sink_for(send: Send, *, require_measurable: bool = False) -> Sink:
    """The sink of the server behind ``send`` (after ``http.response.start``)."""
    from realtime_app.outbound.daphne import daphne_request
    from realtime_app.outbound.uvicorn import UvicornHttpSink, uvicorn_cycle

    raw = server_send(send)
    request = daphne_request(raw)
    if request is None and getattr((getattr(raw, "args", None) or (None,))[0], "channel", True) is None:
        raise ConnectionError("the client went away before its stream began")  # daphne's request, its socket gone
    if request is not None:
        from realtime_app.outbound.daphne import DaphneHttpSink

        return DaphneHttpSink(request)
    owner = getattr(raw, "__self__", None)
    if isinstance(owner, asyncio.Queue):
        return QueueSink(raw)
    if uvicorn_cycle(owner):
        return UvicornHttpSink(owner)
    if require_measurable:
        raise UnsupportedServer(raw)
    return AsgiSink(send)
