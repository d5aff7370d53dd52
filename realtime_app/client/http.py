"""HTTP/1.1 over asyncio streams, as much as the SSE transport needs: one request, its
status and headers, its body read whole (an RPC's answer) or piece by piece (a stream),
chunked or not, over TCP or TLS. The standard library only: the client adds no
dependency for its fallback transport."""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["HttpResponse", "open_request"]

#: Bytes of a response's head at most.
MAX_HEAD = 64 * 1024


class HttpResponse:
    """A response being read: ``status``, ``headers`` (lower-case names), then the body."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}

    async def _head(self) -> None:
        head = await self.reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD:
            raise ConnectionError("response head over the bound")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for line in lines:
            name, colon, value = line.partition(":")
            if colon:
                self.headers[name.strip().lower()] = value.strip()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        reader = self.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)
                yield data
        elif "content-length" in self.headers:
            yield await reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data

    async def body(self, limit: int = 16 * 1024 * 1024) -> bytes:
        out = b""
        async for piece in self.pieces():
            out += piece
            if len(out) > limit:
                raise ConnectionError("response body over the bound")
        return out

    def close(self) -> None:
        self.writer.close()


async def open_request(
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    ssl_context: Any = None,
    timeout: float = 10.0,
) -> HttpResponse:
    """Send one request to ``url`` (http or https) and read its head."""
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    context = (ssl_context or ssl.create_default_context()) if secure else None
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port, ssl=context), timeout)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    response = HttpResponse(reader, writer)
    try:
        await asyncio.wait_for(response._head(), timeout)
    except BaseException:
        writer.close()
        raise
    return response
