"""A Server-Sent Events stream of ``GET /realtime/sse`` read back as the socket's frames.

The clients speak JSON-RPC; over SSE the server speaks events
(:mod:`realtime_app.outbound.sse`). :class:`EventParser` reads the stream as the WHATWG
``EventSource`` does (lines, ``data`` joined, ``id``, ``retry``, comments) and
:func:`translate` turns each event into what the client's session reads from a socket:

* a publication (``event: <channel>``) → the ``message`` notification;
* ``realtime.<method>`` (``token_expiring``) → that notification;
* ``realtime.subscribed`` / ``realtime.error`` → the answer to the stream's next channel's
  ``subscribe`` (``("answer", result)`` / ``("refused", error)``);
* ``realtime.close`` → ``("close", code, reason)``; ``realtime.resync`` → nothing (the
  subscribe answer carries ``recovered: false`` to the client's cursor).

Pure; the browser module's twin (``EventParser``, ``translateEvent``) passes
``tests/vectors/event_stream.json`` too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["EventParser", "StreamEvent", "translate"]

#: Bytes of one event at most (a publication is bounded far below: MAX_PUBLICATION_BYTES).
MAX_EVENT_BYTES = 16 * 1024 * 1024


@dataclass(slots=True)
class StreamEvent:
    event: str
    data: str
    id: str | None  # the stream's last id when the event was dispatched


class EventParser:
    """Feed text as it arrives; get the events it completes."""

    def __init__(self) -> None:
        self.buffer = ""
        self.last_id: str | None = None
        self.retry_ms: int | None = None
        self._event = ""
        self._data: list[str] = []
        self._size = 0

    def feed(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        self.buffer += text
        while True:
            cut = _line_end(self.buffer)
            if cut is None:
                break
            line, self.buffer = self.buffer[: cut[0]], self.buffer[cut[1] :]
            event = self._line(line)
            if event is not None:
                out.append(event)
        if len(self.buffer) > MAX_EVENT_BYTES:
            raise ValueError("event stream line over the bound")
        return out

    def _line(self, line: str) -> StreamEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = StreamEvent(self._event or "message", "\n".join(self._data), self.last_id)
            self._event, self._data, self._size = "", [], 0
            return event
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._size += len(value)
            if self._size > MAX_EVENT_BYTES:
                raise ValueError("event over the bound")
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None


def _line_end(text: str) -> tuple[int, int] | None:
    """Where the first line of ``text`` ends (CRLF, LF or CR) and the next begins."""
    lf, cr = text.find("\n"), text.find("\r")
    if cr == -1 and lf == -1:
        return None
    if cr == -1 or (lf != -1 and lf < cr):
        return lf, lf + 1
    if cr + 1 == len(text):
        return None  # a CR at the end: maybe the first half of a CRLF
    return (cr, cr + 2) if text[cr + 1] == "\n" else (cr, cr + 1)


def translate(event: StreamEvent) -> tuple[Any, ...]:
    """What ``event`` is to the client: ``("frame", text)``, ``("answer", result)``,
    ``("refused", error)``, ``("close", code, reason)`` or ``("skip",)``."""
    name = event.event
    if not name.startswith("realtime."):
        return ("frame", '{"jsonrpc":"2.0","method":"message","params":' + event.data + "}")
    try:
        data = json.loads(event.data)
    except ValueError:
        return ("skip",)
    kind = name[len("realtime.") :]
    if kind == "subscribed":
        return ("answer", data)
    if kind == "error":
        return ("refused", data.get("error") if isinstance(data, dict) else data)
    if kind == "close":
        data = data if isinstance(data, dict) else {}
        return ("close", int(data.get("code", 1006)), str(data.get("reason", "")))
    if kind == "resync":
        return ("skip",)
    message = {"jsonrpc": "2.0", "method": kind, "params": data}
    return ("frame", json.dumps(message, separators=(",", ":"), ensure_ascii=False))
