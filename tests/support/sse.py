"""A raw Server-Sent Events reader for the tests: HTTP/1.1 over asyncio streams, chunked
bodies, the event format of the WHATWG spec — written apart from the clients under test,
so that a test reads what a browser would."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import Any


class SseStream:
    """One ``GET /realtime/sse`` on 127.0.0.1:``port``."""

    def __init__(self, port: int, channels: list[str], headers: dict[str, str] | None = None, query: str = "") -> None:
        self.port = port
        self.path = "/realtime/sse?" + "&".join(f"channel={urllib.parse.quote(c)}" for c in channels)
        if query:
            self.path += "&" + query
        self.headers = headers or {}
        self.status = 0
        self.response_headers: dict[str, str] = {}
        self.body = b""  # the refusal's body (a status other than 200)
        self.events: list[dict[str, Any]] = []  # every event and comment read, in order
        self.ended = False
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._pending = b""
        self._event: dict[str, Any] = {}

    async def open(self) -> SseStream:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        lines = [f"GET {self.path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}", "Accept: text/event-stream"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 15)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for line in header_lines:
            if ":" in line:
                name, _, value = line.partition(":")
                self.response_headers[name.strip().lower()] = value.strip()
        if self.status != 200:
            length = int(self.response_headers.get("content-length", "0"))
            self.body = await asyncio.wait_for(self.reader.readexactly(length), 15) if length else b""
            self.writer.close()
        return self

    def json(self) -> Any:
        return json.loads(self.body)

    def pause(self) -> None:
        """Stop reading: TCP fills up and the server's queue grows."""
        assert self.writer is not None
        self.writer.transport.pause_reading()  # type: ignore[attr-defined]

    def resume(self) -> None:
        assert self.writer is not None
        self.writer.transport.resume_reading()  # type: ignore[attr-defined]

    async def _chunk(self) -> bytes:
        """The next piece of the body (chunked or not); b"" at its end."""
        assert self.reader is not None
        if self.response_headers.get("transfer-encoding", "").lower() != "chunked":
            return await self.reader.read(65536)
        size_line = await self.reader.readuntil(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            await self.reader.readuntil(b"\r\n")
            return b""
        data = await self.reader.readexactly(size)
        await self.reader.readexactly(2)
        return data

    def _feed(self, data: bytes) -> None:
        self._pending += data
        while b"\n" in self._pending:
            raw, _, self._pending = self._pending.partition(b"\n")
            line = raw.rstrip(b"\r").decode("utf-8")
            if line == "":
                if self._event:
                    event = self._event
                    if "data" in event:
                        event["json"] = json.loads(event["data"])
                    self.events.append(event)
                self._event = {}
            elif line.startswith(":"):
                self.events.append({"comment": line[1:]})
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data" and "data" in self._event:
                    value = self._event["data"] + "\n" + value
                self._event[name] = value

    async def read_until(self, predicate: Any, timeout: float = 15.0, what: str = "") -> dict[str, Any]:
        """Read until an event satisfies ``predicate`` (returned); fails past ``timeout``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            left = deadline - time.monotonic()
            if self.ended or left <= 0:
                last = [(e.get("event"), _seq(e)) for e in self.events[-10:]]
                raise AssertionError(f"no event {what or predicate} (ended={self.ended}); the last: {last}")
            try:
                data = await asyncio.wait_for(self._chunk(), left)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                data = b""
                if time.monotonic() >= deadline:
                    continue
            if not data:
                self.ended = True
            self._feed(data)

    async def read_to_end(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Every event until the server ends the response."""
        try:
            await self.read_until(lambda e: False, timeout, "end")
        except AssertionError:
            if not self.ended:
                raise
        return self.events

    def publications(self, channel: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if "event" in e and not e["event"].startswith("realtime.") and (channel is None or e["event"] == channel)
        ]

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _seq(event: dict[str, Any]) -> Any:
    data = event.get("json")
    return data.get("seq") if isinstance(data, dict) else None


async def rpc(port: int, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """``POST /realtime/rpc``: (status, JSON body or None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        "POST /realtime/rpc HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", payload
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if not size:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        payload = out
    return status, json.loads(payload) if payload else None
