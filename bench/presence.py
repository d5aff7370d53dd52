"""Presence: one diff per interval vs one message per join/leave, side by side in one run.

One daphne process of the bench site on Redis (a key prefix of its own) serves both ways:

* **presence** (realtime_app): ``--members`` member sockets on ``/presence-bench/``, each a
  user of its own, join and leave ``bench:presence`` (declared ``presence=True``) with
  ``subscribe`` / ``unsubscribe``; the watchers subscribe with ``"presence": true`` and keep
  the member set by applying each notification (``realtime_app.wire.presence.apply``);
* **group** (the way a Channels app does it): the same members on ``/presence-baseline/``,
  each join or leave one ``group_send`` of ``{"joined"|"left": [user]}`` to the watchers'
  group; the watchers apply each.

For each number of watchers (``--watchers``), both phases run the same seeded sequence of
joins and leaves at ``--rate`` a second for ``--seconds``, starting from three quarters of
the members in the room; every member is listed (``PRESENCE_DIFF_MEMBERS`` raised above the
room), so that both ways are asked the same accuracy. Printed per phase: frames and bytes per watcher per second, the
server's CPU per second, the time the last watcher took to hold the truth after the last
change, and how many watchers hold exactly the true member set then (the final accuracy);
then the ratios group / presence. ``--plot FILE`` draws frames per watcher per second.

Usage: REDIS_URL=redis://127.0.0.1:6379/0 python bench/presence.py [--members 2000]
           [--watchers 100 1000] [--rate 50] [--seconds 20] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import websockets

from bench.common import as_new_client, cpu_seconds, daphne, free_port, prepare_database, processes, progress
from realtime_app.wire.presence import apply

CHANNEL = "bench:presence"
SETTLE_S = 30.0


class Watcher:
    """One watching socket: frames and bytes counted while ``recording``, the member set kept."""

    def __init__(self, ws: Any, way: str) -> None:
        self.ws, self.way = ws, way
        self.members: set[str] = set()
        self.kept: dict[str, dict] = {}
        self.frames = self.bytes = 0
        self.recording = False
        self.last = 0.0

    def take(self, text: str) -> None:
        message = json.loads(text)
        if self.way == "presence":
            if message.get("method") != "presence":
                return
            self.kept = apply(self.kept, message["params"])
            self.members = set(self.kept)
        else:
            self.members |= set(message.get("joined", ()))
            self.members -= set(message.get("left", ()))
        self.last = time.monotonic()
        if self.recording:
            self.frames += 1
            self.bytes += len(text.encode("utf-8"))

    async def read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed, asyncio.CancelledError):
            async for text in self.ws:
                self.take(text if isinstance(text, str) else text.decode())


async def drain(ws: Any) -> None:
    """A member's socket: its answers read and dropped."""
    with contextlib.suppress(websockets.ConnectionClosed, asyncio.CancelledError):
        async for _ in ws:
            pass


async def connect(url: str, sem: asyncio.Semaphore, headers: dict[str, str] | None = None) -> Any:
    async with sem:
        return await websockets.connect(
            url, origin="http://127.0.0.1", max_size=None, open_timeout=60, ping_interval=None, compression=None,
            additional_headers=headers or as_new_client(),
        )  # fmt: skip


async def phase(base: str, way: str, members: int, watchers: int, rate: float, seconds: float, pid: int) -> dict:
    sem = asyncio.Semaphore(64)
    path = "presence-bench" if way == "presence" else "presence-baseline"
    progress(f"{way}: {members} members, {watchers} watchers")
    member_ws = await asyncio.gather(*(connect(f"{base}/{path}/?user=m{n:05d}", sem) for n in range(members)))
    readers = [asyncio.create_task(drain(ws)) for ws in member_ws]
    rng = random.Random(1)
    inside = [n < members * 3 // 4 for n in range(members)]

    lost: list[str] = []  # member sockets the server closed (what it says why)

    async def flip(n: int, join: bool) -> bool:
        """One join or leave; False when the member's socket was closed by the server."""
        try:
            if way == "presence":
                method = "subscribe" if join else "unsubscribe"
                text = json.dumps({"jsonrpc": "2.0", "method": method, "params": {"channel": CHANNEL}})
                await member_ws[n].send(text)
            else:
                await member_ws[n].send("join" if join else "leave")
        except websockets.ConnectionClosed as closed:
            lost.append(str(closed))
            return False
        return True

    for n in range(members):  # the room fills at 500 joins a second (a burst past the layer's pool fails)
        if inside[n]:
            inside[n] = await flip(n, True)
            if n % 25 == 0:
                await asyncio.sleep(0.05)
    watcher_ws = await asyncio.gather(*(connect(f"{base}/{path}/", sem) for _ in range(watchers)))
    watching = [Watcher(ws, way) for ws in watcher_ws]
    for w in watching:
        if way == "presence":
            await w.ws.send(
                json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": CHANNEL, "presence": True}})
            )
        else:  # the group way has no state to ask for: the watchers start from the truth
            w.members = {f"m{n:05d}" for n in range(members) if inside[n]}
    tasks = [asyncio.create_task(w.read()) for w in watching]
    truth = {f"m{n:05d}" for n in range(members) if inside[n]}
    if way == "presence":
        await until(lambda: all(w.members == truth for w in watching), SETTLE_S)
    for w in watching:
        w.recording = True
    progress(f"{way}: {rate:g} joins and leaves a second for {seconds:g} s")
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    changes = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    while time.monotonic() - t0 < seconds:
        n = rng.randrange(members)
        if await flip(n, not inside[n]):
            inside[n] = not inside[n]
            changes += 1
        deadline += 1 / rate
        await asyncio.sleep(max(0.0, deadline - loop.time()))
    elapsed = time.monotonic() - t0
    last_change = time.monotonic()
    truth = {f"m{n:05d}" for n in range(members) if inside[n]}
    settled = await until(lambda: all(w.members == truth for w in watching), SETTLE_S)
    cpu = cpu_seconds(pid) - cpu0
    window = time.monotonic() - t0
    accurate = sum(w.members == truth for w in watching)
    result = {
        "way": way,
        "watchers": watchers,
        "members": members,
        "changes": changes,
        "changes_per_s": round(changes / elapsed, 1),
        "frames_per_watcher_s": round(sum(w.frames for w in watching) / watchers / elapsed, 2),
        "bytes_per_watcher_s": round(sum(w.bytes for w in watching) / watchers / elapsed),
        "server_cpu_per_s": round(cpu / window, 3),
        "settled_s": round(settled - last_change, 2) if settled else None,
        "accurate_watchers": accurate,
        "members_closed": len(lost),
        "closed_because": sorted(set(lost))[:3],
    }
    for task in tasks + readers:
        task.cancel()
    await asyncio.gather(*(ws.close() for ws in member_ws + watcher_ws), return_exceptions=True)
    await asyncio.gather(*tasks, *readers, return_exceptions=True)
    return result


async def until(condition: Any, timeout: float) -> float | None:
    """When ``condition()`` first held (monotonic), None if not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)
    return time.monotonic()


def report(results: list[dict]) -> None:
    columns = [
        "way", "watchers", "changes_per_s", "frames_per_watcher_s", "bytes_per_watcher_s", "server_cpu_per_s",
        "settled_s", "accurate_watchers", "members_closed",
    ]  # fmt: skip
    print(" | ".join(columns))
    for row in results:
        print(" | ".join(str(row[c]) for c in columns))
    for watchers in sorted({r["watchers"] for r in results}):
        ours = next(r for r in results if r["watchers"] == watchers and r["way"] == "presence")
        group = next(r for r in results if r["watchers"] == watchers and r["way"] == "group")
        # the group way must send one frame per change to every watcher to be exact: what it
        # delivered falls short when the server cannot keep up (then it is not exact either)
        required = group["changes_per_s"] / max(ours["frames_per_watcher_s"], 1e-9)
        frames = group["frames_per_watcher_s"] / max(ours["frames_per_watcher_s"], 1e-9)
        cpu = group["server_cpu_per_s"] / max(ours["server_cpu_per_s"], 1e-9)
        exact = f"{group['accurate_watchers']}/{watchers} vs {ours['accurate_watchers']}/{watchers} watchers exact"
        print(
            f"{watchers} watchers: group / presence = {required:.0f}x frames required ({frames:.1f}x delivered), "
            f"{cpu:.1f}x server CPU; {exact}"
        )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    watchers = sorted({r["watchers"] for r in results})
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for way, colour in (("group", "tab:red"), ("presence", "tab:blue")):
        rows = [next(r for r in results if r["watchers"] == w and r["way"] == way) for w in watchers]
        labels = [str(w) for w in watchers]
        offset = -0.2 if way == "group" else 0.2
        xs = [i + offset for i in range(len(watchers))]
        ax[0].bar(xs, [r["frames_per_watcher_s"] for r in rows], 0.4, label=f"{way}: delivered", color=colour)
        if way == "group":  # exact only with one frame per change: what it falls short of
            needed = [r["changes_per_s"] - r["frames_per_watcher_s"] for r in rows]
            bottom = [r["frames_per_watcher_s"] for r in rows]
            ax[0].bar(xs, needed, 0.4, bottom=bottom, label="group: required, not delivered", color="none",
                      edgecolor=colour, hatch="//")  # fmt: skip
        ax[1].bar(xs, [r["server_cpu_per_s"] * 100 for r in rows], 0.4, label=way, color=colour)
    ax[0].set_yscale("log")
    ax[0].set_ylim(0.5, 100)
    for axis, title in ((ax[0], "frames per watcher per second (log)"), (ax[1], "server CPU, % of a core")):
        axis.set_xticks(range(len(watchers)), labels)
        axis.set_xlabel("watchers")
        axis.set_title(title)
        axis.legend()
    members, rate = results[0]["members"], results[0]["changes_per_s"]
    fig.suptitle(f"Presence of a room of {members} members, ~{rate:g} joins/leaves per second")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=2000)
    parser.add_argument("--watchers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"rt-bench-presence-{secrets.token_hex(3)}"
    # every member listed in every diff (PRESENCE_DIFF_MEMBERS above the room), so that both
    # ways end at the same accuracy: the full member set in each watcher
    overrides = {"MAX_ANONYMOUS_HANDSHAKES_PER_S": 5000.0, "MAX_CONNECTIONS": 20000, "PRESENCE_DIFF_MEMBERS": 100_000}
    database = prepare_database(str(Path(tempfile.mkdtemp()) / "db.sqlite3"))
    env = {
        **database,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REDIS_URL": redis_url,
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_BENCH_OVERRIDES": json.dumps(overrides),
    }
    port = free_port()
    results = []
    try:
        with processes([daphne(port)], [port], env) as (server,):
            for watchers in args.watchers:
                for way in ("presence", "group"):
                    results.append(
                        await phase(
                            f"ws://127.0.0.1:{port}", way, args.members, watchers, args.rate, args.seconds, server.pid
                        )
                    )
                    print(json.dumps(results[-1]), flush=True)
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
