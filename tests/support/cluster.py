"""Helpers of the cluster tests: a reader of frames in the background, and a publication
from a management command (``manage.py shell -c``, as an operator's script would)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

import websockets

from tests.support.servers import ROOT
from tests.support.wsclient import RPC


class Reader:
    """A subscribed client whose frames are collected in the background, with when; the
    answers of its subscribes in ``positions``, its close code in ``closed``."""

    def __init__(self, url: str, channels: list[str], address: str | None = None) -> None:
        self.rpc = RPC(url, address=address)
        self.channels = channels
        self.frames: list[tuple[float, dict[str, Any]]] = []
        self.positions: dict[str, dict[str, Any]] = {}
        self.closed: int | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Reader:
        await self.rpc.__aenter__()
        for channel in self.channels:
            self.positions[channel] = await self.rpc.subscribe(channel)
        self._task = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for raw in self.rpc.ws:
                message = json.loads(raw)
                if message.get("method") == "message":
                    self.frames.append((time.monotonic(), message["params"]))
        except websockets.ConnectionClosed as exc:
            self.closed = exc.rcvd.code if exc.rcvd else 1006
        else:
            self.closed = self.rpc.ws.close_code

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.rpc.__aexit__()

    def seqs(self, channel: str) -> list[int]:
        return [f["seq"] for _, f in self.frames if f["channel"] == channel]

    def has_frame_after(self, channel: str, moment: float) -> bool:
        return any(t > moment and f["channel"] == channel for t, f in self.frames)


async def publish_from_a_command(env: dict[str, str], channel: str, data: Any) -> int:
    """Publish ``data`` from ``manage.py shell -c`` with the servers' environment: its ``seq``."""
    code = f"from realtime_app import publish; print(publish({channel!r}, {data!r}))"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "manage.py",
        "shell",
        "-c",
        code,
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        stdout=asyncio.subprocess.PIPE,
    )
    stdout, _ = await process.communicate()
    assert process.returncode == 0
    return int(stdout.decode().strip().splitlines()[-1])
