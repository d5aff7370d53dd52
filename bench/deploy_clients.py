"""The deploy benchmark's clients, in worker processes of their own (``bench/deploy.py``).

On a small machine one process's CPU bounds how fast thousands of clients come back, so
``bench/deploy.py`` splits them over ``--client-processes`` workers, each running this
module: ``python bench/deploy_clients.py SPEC`` (a JSON object: ``url``, ``first``,
``count``, ``loop``). A worker speaks JSON lines on a descriptor of its own (its stdout
at start; ``sys.stdout`` then points at stderr, so that nothing printed can break the
stream): ``{"open": n}`` every ``SAMPLE_S`` unasked, and one reply per command read from
stdin, tagged with the command's ``id``:

* ``connect``: every client connects; the reply when all are open, or after 120 s;
* ``deploy``: closes counted apart from now on, and each client's way back watched;
* ``away``: the clients not open now, by their last close (and how many are open);
* ``missing``: how many clients lack one of ``seqs``;
* ``finish``: for ``seqs``, how many each client lacks, which some client lacks and the
  latest arrival of each; the closes by code and reason; the ways back; then the clients
  close and the worker ends.

Arrival times are ``time.monotonic()``: on Linux one clock for every process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile

SAMPLE_S = 0.25


def told_as_any(reason: str) -> str:
    """A close reason with its ``retry_after_ms=<n>`` as ``retry_after_ms=…`` (and its
    reconnect ticket as ``ticket=…``): closes counted by what they said, not by each wait."""
    return re.sub(r"ticket=\S+", "ticket=…", re.sub(r"retry_after_ms=\d+", "retry_after_ms=…", reason))


class Clients:
    """The coordinator's side: the workers, their latest open counts, their replies."""

    def __init__(self, workers: list[asyncio.subprocess.Process]) -> None:
        self.workers = workers
        self.open = [0] * len(workers)
        self.replies: list[asyncio.Queue[dict[str, Any]]] = [asyncio.Queue() for _ in workers]
        self.readers = [asyncio.create_task(self._read(i)) for i in range(len(workers))]
        self.ids = itertools.count()
        self.lost: str | None = None  # why a worker is gone, once one is

    @classmethod
    async def start(cls, url: str, count: int, processes: int, loop: str) -> Clients:
        if processes < 1 or count < processes:
            raise ValueError(f"{count} clients over {processes} worker processes")
        sizes = [count // processes + (i < count % processes) for i in range(processes)]
        workers: list[asyncio.subprocess.Process] = []
        try:
            for i, size in enumerate(sizes):
                spec = {"url": url, "first": sum(sizes[:i]), "count": size, "loop": loop}
                workers.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        __file__,
                        json.dumps(spec),
                        stdout=asyncio.subprocess.PIPE,
                        stdin=asyncio.subprocess.PIPE,
                        limit=1 << 24,  # a reply carries a few numbers per client
                    )
                )
        except BaseException:
            for worker in workers:
                with contextlib.suppress(ProcessLookupError):
                    worker.kill()
            raise
        return cls(workers)

    async def _read(self, i: int) -> None:
        worker = self.workers[i]
        assert worker.stdout is not None
        try:
            while line := await worker.stdout.readline():
                message = json.loads(line)
                if "open" in message:
                    self.open[i] = message["open"]
                else:
                    await self.replies[i].put(message)
            why = f"client worker {i} exited with {await worker.wait()}"
        except Exception as exc:  # a line past the limit, or not JSON: the stream is lost
            why = f"client worker {i}'s stream broke: {exc!r}"
        self.lost = self.lost or why
        self.open[i] = 0
        await self.replies[i].put({"lost": why})

    async def ask(self, command: dict[str, Any], timeout: float = 300) -> list[dict[str, Any]]:
        """Every worker's reply to ``command`` (tagged: a reply to an earlier command that
        timed out is skipped). One ask at a time: two would take each other's replies."""
        self.check()
        tag = next(self.ids)
        for worker in self.workers:
            assert worker.stdin is not None
            worker.stdin.write(json.dumps({**command, "id": tag}).encode() + b"\n")
            await worker.stdin.drain()

        async def reply(queue: asyncio.Queue[dict[str, Any]]) -> dict[str, Any]:
            while True:
                message = await queue.get()
                if "lost" in message:
                    raise RuntimeError(message["lost"])
                if message.get("id") == tag:
                    return message

        replies = await asyncio.wait_for(
            asyncio.gather(*(reply(q) for q in self.replies), return_exceptions=True), timeout
        )
        for result in replies:
            if isinstance(result, BaseException):
                raise result
        return [result for result in replies if not isinstance(result, BaseException)]

    def check(self) -> None:
        if self.lost:
            raise RuntimeError(self.lost)

    def opened(self) -> int:
        """Clients open, as the workers last said (each within ``SAMPLE_S``)."""
        self.check()
        return sum(self.open)

    async def aclose(self, grace: float = 15) -> None:
        """Each worker's stdin closed (its clients close and it ends), then killed after ``grace``."""
        for worker in self.workers:
            if worker.stdin is not None:
                worker.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.wait() for w in self.workers)), grace)
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
        await asyncio.gather(*(worker.wait() for worker in self.workers), return_exceptions=True)
        for reader in self.readers:
            reader.cancel()
        for result in await asyncio.gather(*self.readers, return_exceptions=True):
            if isinstance(result, Exception):
                print(f"a client worker's reader failed: {result!r}", file=sys.stderr)


class WaysBack:
    """Each client's longest way back during the deploy: from the close that took it away
    until its next connection opened (the handshake done), with the handshakes that failed
    on the way and how the first and last of those closes read."""

    def __init__(self, phase: list[str]) -> None:
        self.phase = phase
        self.longest: list[tuple[float, int, str, str] | None] = []
        self.away: list[list[Any]] = []  # per client: [since, failed, first close, last close] while away

    def watch(self, client: Any) -> None:
        index = len(self.longest)
        self.longest.append(None)
        self.away.append([])
        away = self.away[index]

        def closed(code: int | None, reason: str, again: bool) -> None:
            if self.phase[0] != "deploy":
                return
            why = f"{code} {told_as_any(reason)}"
            if away:
                away[1] += 1
                away[3] = why
            else:
                away.extend([time.monotonic(), 0, why, why])

        def state(now: str) -> None:
            if now == "open" and away:
                since, failed, first, last = away
                away.clear()
                self.keep(index, (round(time.monotonic() - since, 3), failed, first, last))

        client.on_close.append(closed)
        client.on_state.append(state)

    def keep(self, index: int, way: tuple[float, int, str, str]) -> None:
        held = self.longest[index]
        if held is None or way[0] > held[0]:
            self.longest[index] = way

    def report(self) -> dict[str, Any]:
        """The longest way back of each client that left; those still away counted to now
        (``"back": false``)."""
        now = time.monotonic()
        ways = [{"s": w[0], "failed": w[1], "first": w[2], "last": w[3], "back": True} for w in self.longest if w]
        for away in self.away:
            if away:
                since, failed, first, last = away
                ways.append({"s": round(now - since, 3), "failed": failed, "first": first, "last": last, "back": False})
        return {"ways": ways}


def ways_back_summary(ways: list[dict[str, Any]]) -> dict[str, Any]:
    """Each client's longest way back (close to next open, during the deploy): p50, p99,
    the longest, and the slowest five with the handshakes that failed on the way."""
    gaps = [way["s"] for way in ways]
    return {
        "clients": len(gaps),
        "not_back": sum(1 for way in ways if not way["back"]),
        "p50_s": round(percentile(gaps, 50), 2) if gaps else None,
        "p99_s": round(percentile(gaps, 99), 2) if gaps else None,
        "max_s": round(max(gaps), 2) if gaps else None,
        "slowest": sorted(ways, key=lambda way: -way["s"])[:5],
    }


async def worker_main(spec: dict[str, Any], out: Any) -> None:
    import django

    django.setup()
    from realtime_app.client import RealtimeClient

    clients: list[Any] = []
    received: list[dict[int, float]] = []
    closes: dict[str, collections.Counter[str]] = {"connecting": collections.Counter(), "deploy": collections.Counter()}
    phase = ["connecting"]
    ways = WaysBack(phase)

    def count_close(code: int | None, reason: str) -> None:
        if phase[0] in closes:  # the teardown's own are not counted
            closes[phase[0]].update([f"{code} {told_as_any(reason)}"])

    def handler_for(seen: dict[int, float]) -> Any:
        return lambda params: seen.setdefault(int(params["seq"]), time.monotonic())

    for n in range(spec["first"], spec["first"] + spec["count"]):
        seen: dict[int, float] = {}
        address = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        client = RealtimeClient(
            spec["url"],
            origin="http://127.0.0.1",
            headers={"X-Forwarded-For": address},
            backoff_initial=0.5,
            backoff_max=10,
            open_timeout=30,
            ping_interval=None,
            compression=None,
        )
        await client.subscribe("demo:events", handler_for(seen))
        client.on_close.append(lambda code, reason, again: count_close(code, reason))
        ways.watch(client)
        clients.append(client)
        received.append(seen)

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    def opened() -> int:
        return sum(c.state == "open" for c in clients)

    async def tell_open() -> None:
        while True:
            say({"open": opened()})
            await asyncio.sleep(SAMPLE_S)

    async def answer(command: dict[str, Any]) -> dict[str, Any]:
        do = command["do"]
        if do == "connect":
            opening = asyncio.gather(*(c.connect(timeout=180) for c in clients), return_exceptions=True)
            deadline = time.monotonic() + 120
            while opened() < len(clients) and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
            await opening
            return {"connected": opened()}
        if do == "deploy":
            phase[0] = "deploy"
            return {}
        if do == "away":
            away = collections.Counter(
                "{} {}".format(*(c.last_close or (None, ""))) for c in clients if c.state != "open"
            )
            return {"opened": opened(), "away": dict(away)}
        if do == "missing":
            seqs = command["seqs"]
            return {"missing": sum(1 for seen in received if any(seq not in seen for seq in seqs))}
        if do == "finish":
            phase[0] = "teardown"
            seqs = command["seqs"]
            latest = {seq: max((seen[seq] for seen in received if seq in seen), default=None) for seq in seqs}
            return {
                "missing": [sum(1 for seq in seqs if seq not in seen) for seen in received],
                "lacking": [seq for seq in seqs if any(seq not in seen for seen in received)],
                "latest": latest,
                "closes": {when: dict(counter) for when, counter in closes.items()},
                **ways.report(),
            }
        raise ValueError(f"unknown command {do!r}")

    teller = asyncio.create_task(tell_open())
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = json.loads(line)
            say({**await answer(command), "id": command["id"]})
            if command["do"] == "finish":
                break
    finally:
        teller.cancel()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")  # the protocol's own descriptor
    os.dup2(2, 1)  # whatever is printed goes to stderr: nothing can break the stream
    sys.stdout = sys.stderr
    if spec["loop"] == "uvloop":
        import uvloop

        uvloop.run(worker_main(spec, out))
    else:
        asyncio.run(worker_main(spec, out))


if __name__ == "__main__":
    main()
