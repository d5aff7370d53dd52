"""Helpers shared by the benchmarks: server processes, CPU accounting, clients, stats."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_port(port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout} s")


@contextlib.contextmanager
def processes(
    commands: list[list[str]], ports: list[int], env: dict[str, str]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for cmd in commands
    ]
    try:
        for port, proc in zip(ports, procs, strict=True):
            wait_port(port, proc)
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def uvicorn(port: int, deflate: bool = False) -> list[str]:
    """A uvicorn process of the bench site, with the WebSocket implementation the guard
    supports (``websockets-sansio``); ``deflate``: permessage-deflate offered."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ws",
        "websockets-sansio",
        "--ws-per-message-deflate",
        str(deflate).lower(),
        "--lifespan",
        "off",
        "--log-level",
        "warning",
        "bench.asgi:application",
    ]


def daphne(port: int, app: str = "bench.asgi:application") -> list[str]:
    return [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), app]


@dataclass
class Collector:
    """Counts frames and latencies (now − ts) while ``recording`` is on."""

    recording: bool = False
    frames: int = 0
    latencies: list[float] = field(default_factory=list)

    def note(self, text: str | bytes) -> None:
        if not self.recording:
            return
        self.frames += 1
        message = json.loads(text)
        params = message.get("params") if isinstance(message, dict) else None
        if params and "ts" in params:
            self.latencies.append(time.time() * 1000 - params["ts"])


def redis_site(overrides: dict[str, Any] | None = None) -> tuple[str, str, dict[str, str]]:
    """``REDIS_URL`` (the script exits saying how to set it), a key prefix of this run's
    own, and the environment of the bench site's servers on them; ``overrides``:
    ``REALTIME_APP`` keys the servers change (bench/settings.py reads them)."""
    url = os.environ.get("REDIS_URL")
    if not url:
        sys.exit("set REDIS_URL (e.g. redis://127.0.0.1:6379/0)")
    prefix = f"bench-{secrets.token_hex(3)}"
    env = {"REDIS_URL": url, "REALTIME_KEY_PREFIX": prefix, "DJANGO_SETTINGS_MODULE": "bench.settings"}
    if overrides:
        env["REALTIME_BENCH_OVERRIDES"] = json.dumps(overrides)
    return url, prefix, env


def drop_keys(url: str, prefix: str) -> None:
    """This run's keys, and only them."""
    import redis

    r = redis.Redis.from_url(url)
    for key in r.scan_iter(match=f"{prefix}*"):
        r.delete(key)


async def open_ws(url: str, open_timeout: float = 120, **extra: Any) -> Any:
    """A benchmark's WebSocket: a client of its own (``as_new_client``), no client
    pings, no compression, no size limit; ``extra``: more of ``websockets.connect``'s."""
    return await websockets.connect(
        url,
        origin="http://127.0.0.1",
        open_timeout=open_timeout,
        ping_interval=None,
        compression=None,
        max_size=None,
        additional_headers=as_new_client(),
        **extra,
    )


async def client(
    url: str,
    collector: Collector,
    subscribe: str | None,
    ready: asyncio.Event,
    connected: list[int],
    stop: asyncio.Event,
    sem: asyncio.Semaphore,
) -> None:
    async with sem:
        ws = await open_ws(url, open_timeout=60)
        if subscribe:
            await ws.send(
                json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": subscribe}, "id": 1})
            )
            await ws.recv()
    connected[0] += 1
    try:
        while not stop.is_set():
            text = await ws.recv()
            collector.note(text)
    except (websockets.ConnectionClosed, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            await ws.close()


_addresses = itertools.count(1)


def as_new_client() -> dict[str, str]:
    """Headers that make a benchmark socket a client of its own (the benchmark settings
    trust 127.0.0.1's X-Forwarded-For): an anonymous identity is its address, and a
    benchmark's thousands of sockets stand for thousands of clients, not one."""
    n = next(_addresses)
    return {"X-Forwarded-For": f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def progress(message: str) -> None:
    print(f"  … {message}", file=sys.stderr, flush=True)


def prepare_database(path: str, settings: str = "project.settings") -> dict[str, str]:
    """Migrate an SQLite file and create the demo users; returns the env naming it."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": settings, "DATABASE_URL": f"sqlite:///{path}"}
    for args in (["migrate", "--noinput", "-v", "0"], ["demo_setup"]):
        subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return {"DATABASE_URL": f"sqlite:///{path}"}


async def settled_rss(pid: int, seconds: float = 3) -> int:
    """RSS once the server is idle: after ``seconds`` of no CPU, the last reading."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        await asyncio.sleep(seconds)
        if cpu_seconds(pid) - before < 0.02 * seconds:
            break
    return rss_bytes(pid)
