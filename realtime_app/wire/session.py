"""A connection's JSON-RPC session, Sans-I/O: the protocol state of one socket, on either end.

python-websockets' shape: the session never reads or writes a socket, never awaits,
never starts a task. It is fed what arrived (a frame's text, an answer, a close) and
returns what to do (frames to send, messages to hand to the application, resumes to
start). ``RealtimeConsumer`` (the server, :class:`ServerSession`) and ``RealtimeClient``
(the Python client, :class:`ClientSession`) are thin adapters around it: everything
either end must remember about the conversation lives here, so it is tested without
sockets (``tests/test_session.py``, a hypothesis machine among them).

* Both ends: bad input counted by reason, the first of each logged and the rest counted
  until the end (:meth:`Session.count_error`); a close decided once (:attr:`Session.closing`).
* The server: which frames are refused before parsing (binary: 1003, too large: 1009),
  the batch bound, and the channels whose current value follows this frame's answer.
* The client: request ids and the requests in flight, the subscribe book (requested
  name → the canonical one the server answered), the delta bases, each history
  channel's cursor (:mod:`realtime_app.wire.cursor`) and each presence channel's members.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from realtime_app.wire import protocol
from realtime_app.wire.cursor import Action, EventCursor
from realtime_app.wire.delta_bases import DeltaBases, DeltaError
from realtime_app.wire.deltas import FOSSIL
from realtime_app.wire.presence import apply as apply_presence
from realtime_app.wire.protocol import CloseCode, Frame

__all__ = [
    "Answer",
    "Close",
    "ClientSession",
    "Deliver",
    "Event",
    "Notify",
    "Recover",
    "Resubscribe",
    "ServerSession",
    "Session",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Close:
    """Close the connection with ``code`` and ``reason``."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer to the request ``id``: ``(True, result)`` or ``(False, error object)``."""

    id: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Deliver:
    """A message of ``channel`` (canonical) for the application's handlers."""

    channel: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Notify:
    """``on_recovered`` / ``on_resync`` / ``on_presence`` (``kind``) of ``channel`` with ``value``."""

    kind: str
    channel: str
    value: Any


@dataclass(frozen=True, slots=True)
class Recover:
    """A gap in ``channel``'s history: subscribe again ``since`` (:meth:`ClientSession.recover_request`)."""

    channel: str


@dataclass(frozen=True, slots=True)
class Resubscribe:
    """A delta did not apply: subscribe ``names`` again for a full frame."""

    channel: str
    names: tuple[str, ...]


Event = Answer | Deliver | Notify | Recover | Resubscribe


class Session:
    """What both ends keep: bad input counted by reason, and the close once decided."""

    def __init__(self) -> None:
        self.errors: dict[str, int] = {}
        self.closing: Close | None = None

    def count_error(self, reason: str) -> bool:
        """Count one bad input of ``reason``: True for the first (log it), False after
        (counted, summed up by :meth:`error_summary` when the connection ends)."""
        seen = self.errors.get(reason, 0)
        self.errors[reason] = seen + 1
        return not seen

    def error_summary(self) -> dict[str, int]:
        """The reasons seen more than once, with their counts (logged once at the end)."""
        return {reason: n for reason, n in self.errors.items() if n > 1}

    def close(self, code: int, reason: str) -> Close | None:
        """Decide to close: the close to send, or None when one was decided already."""
        if self.closing is not None:
            return None
        self.closing = Close(code, reason)
        return self.closing


class ServerSession(Session, Generic[T]):
    """The server's end: frames checked before they are parsed, and the channels
    (``T``: the endpoint's channel spec) whose current value follows a frame's answer."""

    def __init__(self, max_frame_bytes: int, max_batch: int) -> None:
        super().__init__()
        self.max_frame_bytes = max_frame_bytes
        self.max_batch = max_batch
        self.follow: list[T] = []
        self.requests = 0  # requests received (RPC auth must be the connection's first)

    def receive(self, text: str | None) -> Frame | Close | None:
        """One WebSocket frame: its requests and errors, or the close it earns (None once
        the session is closing: what arrives afterwards is ignored)."""
        if self.closing is not None:
            return None
        if text is None:
            return self.close(CloseCode.UNSUPPORTED_DATA, "binary frames are not supported")
        limit = self.max_frame_bytes
        if limit and len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
            return self.close(CloseCode.MESSAGE_TOO_BIG, f"frame over {limit} bytes")
        frame = protocol.parse_frame(text, self.max_batch)
        self.requests += len(frame.requests) + len(frame.errors)
        return frame

    def follow_answer(self, channel: T) -> None:
        """Send ``channel``'s current value after this frame's answer (which names it)."""
        self.follow.append(channel)

    def answered(self) -> list[T]:
        """The channels to send the current value of, now that the answer is out."""
        follow, self.follow = self.follow, []
        return follow


class ClientSession(Session):
    """The client's end: ids, the requests in flight, the subscribe book, delta bases and
    history cursors. Handlers are the adapter's: the session names channels."""

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count(1)
        self.in_flight: dict[int, str] = {}  # id -> method
        self._follows: dict[int, tuple[str, EventCursor]] = {}  # subscribe id -> (channel, cursor)
        self.handlers: dict[str, list[Any]] = {}  # requested name -> the application's handlers
        self.on_error: dict[str, list[Any]] = {}  # requested name -> its refusal callbacks
        self.canonical: dict[str, str] = {}  # requested name -> the server's canonical name
        self.delta_wanted: set[str] = set()  # requested names subscribed with deltas
        self.deltas = DeltaBases()  # canonical channels with deltas granted, and their bases
        self.cursors: dict[str, EventCursor] = {}  # canonical channel -> place in its history
        self.presence_wanted: set[str] = set()  # requested names subscribed with presence
        self.members: dict[str, dict[str, dict[str, Any]]] = {}  # canonical channel -> user -> member

    # -- requests ----------------------------------------------------------------------

    def request(
        self, method: str, params: Any = None, follow: tuple[str, EventCursor] | None = None
    ) -> tuple[int, str]:
        """A request to send: its id and text. ``follow``: a subscribe whose answer moves
        that channel's cursor, in order with the messages around it."""
        request_id = next(self._ids)
        self.in_flight[request_id] = method
        if follow is not None:
            self._follows[request_id] = follow
        return request_id, self.notification(method, params, request_id)

    @staticmethod
    def notification(method: str, params: Any = None, request_id: int | None = None) -> str:
        request: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            request["params"] = params
        if request_id is not None:
            request["id"] = request_id
        return json.dumps(request)

    @staticmethod
    def keyed(params: Any) -> dict[str, Any]:
        """An idempotent call's params with its ``idempotency_key`` (a new one unless
        given): by-name params only."""
        if params is not None and not isinstance(params, dict):
            raise ValueError("an idempotent call takes by-name params (a dict): its key is one of them")
        return {"idempotency_key": uuid.uuid4().hex, **(params or {})}

    def forget(self, request_id: int) -> None:
        """The caller stopped waiting (answered, timed out, cancelled)."""
        self.in_flight.pop(request_id, None)
        self._follows.pop(request_id, None)

    def subscribe_request(self, name: str) -> tuple[dict[str, Any], str, EventCursor]:
        """The params of a subscribe of ``name`` (a resume where its history has a
        position), its canonical channel and cursor (dropped by the answer unless the
        channel keeps a history). Messages that come before the answer wait for it."""
        canonical = self.canonical.get(name, name)
        params: dict[str, Any] = {"channel": name}
        if name in self.delta_wanted or canonical in self.deltas:
            params["delta"] = FOSSIL
        if name in self.presence_wanted:
            params["presence"] = True  # a reset with every member comes first, then the diffs
        cursor = self.cursors.setdefault(canonical, EventCursor())
        since = cursor.since()
        if since is not None:
            params["since"] = since
        cursor.resuming()
        return params, canonical, cursor

    def recover_request(self, channel: str) -> tuple[dict[str, Any], EventCursor] | None:
        """The params of the resume that fills a gap in ``channel``, None when none is due."""
        cursor = self.cursors.get(channel)
        if cursor is None or not cursor.recovering:
            return None
        params: dict[str, Any] = {"channel": channel, "since": cursor.since()}
        if channel in self.deltas:
            params["delta"] = FOSSIL  # the replay comes whole; deltas go on after it
        return params, cursor

    def book(self, name: str, handler: Any, on_error: Any = None, delta: bool = False, presence: bool = False) -> str:
        """The application subscribes ``handler`` to ``name``: ``"first"`` for its first
        handler, ``"again"`` when the server must be asked again (presence newly wanted),
        else ``""``."""
        first = "first" if name not in self.handlers else ""
        if delta:
            self.delta_wanted.add(name)
        if presence and name not in self.presence_wanted:
            self.presence_wanted.add(name)
            first = first or "again"
        self.handlers.setdefault(name, []).append(handler)
        if on_error is not None:
            self.on_error.setdefault(name, []).append(on_error)
        return first

    def handlers_of(self, channel: str) -> list[tuple[str, Any]]:
        """``(name, handler)`` of every requested name that ``channel`` (canonical) serves."""
        return [(n, h) for n, hs in self.handlers.items() if self.canonical.get(n, n) == channel for h in list(hs)]

    def subscribed(self, name: str, result: dict[str, Any]) -> None:
        self.canonical[name] = result["channel"]

    def unbook(self, name: str, handler: Any = None) -> str | None:
        """Remove ``handler`` (None: all) from ``name``. When the last one left: the
        canonical channel to unsubscribe on the server, None while another requested name
        still maps to it (and always None while handlers remain)."""
        handlers = self.handlers.get(name)
        if handlers is None:
            return None
        if handler is None:
            handlers.clear()
        elif handler in handlers:
            handlers.remove(handler)
        if handlers:
            return None
        del self.handlers[name]
        self.on_error.pop(name, None)
        self.delta_wanted.discard(name)
        self.presence_wanted.discard(name)
        canonical = self.canonical.pop(name, name)
        if canonical in self.canonical.values():
            return None
        self.members.pop(canonical, None)
        self.deltas.forget(canonical)
        self.cursors.pop(canonical, None)
        return canonical

    def closed(self) -> list[int]:
        """The connection closed: the ids that will never be answered; every channel
        starts again from a full frame and resumes where it was."""
        for cursor in self.cursors.values():
            cursor.closed()
        self.deltas.reset()
        self.members.clear()  # known again from the reset that follows the next subscribe
        lost = list(self.in_flight)
        self.in_flight.clear()
        self._follows.clear()
        self.closing = None
        return lost

    # -- what arrives ------------------------------------------------------------------

    def receive(self, text: str | bytes) -> list[Event]:
        """One frame from the server: what to do, in order."""
        try:
            message = json.loads(text)
        except ValueError:
            self.count_error("not_json")
            return []
        events: list[Event] = []
        for item in message if isinstance(message, list) else [message]:
            if not isinstance(item, dict):
                continue
            if item.get("method") == "message" and isinstance(item.get("params"), dict):
                events += self._message(item["params"])
            elif item.get("method") == "presence" and isinstance(item.get("params"), dict):
                events += self._presence(item["params"])
            elif item.get("method") == "token_expiring" and isinstance(item.get("params"), dict):
                events.append(Notify("token_expiring", "", item["params"]))  # refresh it: RPC auth
            elif item.get("id") in self.in_flight:
                request_id = item["id"]
                follow = self._follows.pop(request_id, None)
                del self.in_flight[request_id]
                if follow is not None and "result" in item:
                    events += self._answer(*follow, item["result"])
                error = item.get("error")
                if error is None:
                    events.append(Answer(request_id, True, item.get("result")))
                else:
                    events.append(Answer(request_id, False, error if isinstance(error, dict) else {}))
        return events

    def _message(self, params: dict[str, Any]) -> list[Event]:
        channel = params.get("channel")
        if not isinstance(channel, str):
            return []
        if "delta" in params:  # only delta subscriptions carry it
            if channel not in self.deltas:  # its first frame, before the subscribe's answer?
                if channel not in self.delta_wanted and channel not in self.canonical.values():
                    return []  # still in flight after an unsubscribe
                self.deltas.granted(channel)
            try:
                params = self.deltas.rebuild(channel, params)
            except DeltaError:  # never applied to another base: a full frame instead
                if not self.deltas.resync(channel):
                    return []
                names = tuple(n for n, c in self.canonical.items() if c == channel) or (channel,)
                return [Resubscribe(channel, names)]
        if "epoch" in params:  # a channel with history: in order, once
            cursor = self.cursors.get(channel)
            return [] if cursor is None else self._act(channel, cursor.message(params))
        return [Deliver(channel, params)]

    def _presence(self, params: dict[str, Any]) -> list[Event]:
        """A ``presence`` frame applied to the channel's kept member set
        (:func:`realtime_app.wire.presence.apply`); ``Notify("presence")`` with the diff."""
        channel = params.get("channel")
        if not isinstance(channel, str):
            return []
        wanted = (self.canonical.get(n) for n in self.presence_wanted)  # None: its answer still to come
        if channel not in self.members and not any(c is None or c == channel for c in wanted):
            return []  # in flight after an unsubscribe
        self.members[channel] = apply_presence(self.members.get(channel, {}), params)
        return [Notify("presence", channel, params)]

    def _answer(self, channel: str, cursor: EventCursor, result: Any) -> list[Event]:
        """A subscribe's answer applied to the channel's cursor — unless the channel was
        left (and maybe subscribed again) since it was sent."""
        if isinstance(result, dict) and result.get("delta") == FOSSIL:
            self.deltas.granted(result["channel"])
        if not isinstance(result, dict) or self.cursors.get(channel) is not cursor:
            return []
        if "epoch" in result:
            return self._act(channel, cursor.answer(result))
        del self.cursors[channel]  # the channel keeps no history (any more)
        if cursor.epoch is not None and result.get("recovered") is False:
            info = {"epoch": cursor.epoch, "seq": cursor.seq, "reason": result.get("reason", "no_history")}
            return [Notify("resync", channel, info)]
        return []

    @staticmethod
    def _act(channel: str, actions: list[Action]) -> list[Event]:
        events: list[Event] = []
        for kind, value in actions:
            if kind == "deliver":
                events.append(Deliver(channel, value))
            elif kind == "recover":
                events.append(Recover(channel))
            else:
                events.append(Notify(kind, channel, value))
        return events
