"""What a server process costs doing nothing: the hub's own background beside a bare server.

Each server a fresh process, one after the other, with one open WebSocket (which starts
the hub) and nothing published; its CPU over ``--seconds`` after a settling pause, split
by thread (the event loop's, the database thread's, the rest), per round:

* ``hub-uvicorn``: the bench site under uvicorn (``--ws websockets-sansio``), on Redis;
* ``hub-daphne``: the same under daphne;
* ``bare-uvicorn``: uvicorn serving a WebSocket application that accepts and waits —
  what uvicorn itself costs (its main loop wakes ten times a second);
* ``websockets``: a bare ``websockets`` server (the fan-out benchmark's floor).

At 1,000 frames a second (``bench/fanout.py``'s 1,000-subscriber phase) each millisecond a
second of background is a microsecond per frame.

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/idle_process.py [--seconds 60] [--rounds 2]
            [--kinds hub-uvicorn bare-uvicorn ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import daphne, drop_keys, free_port, open_ws, processes, progress, redis_site, uvicorn

KINDS = ["hub-uvicorn", "hub-daphne", "bare-uvicorn", "websockets"]
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A WebSocket application that accepts and waits: uvicorn's own cost."""
    if scope["type"] != "websocket":
        return
    await receive()
    await send({"type": "websocket.accept"})
    while (await receive())["type"] != "websocket.disconnect":
        pass


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU clock ticks of each thread of ``pid``, by the thread's name (summed per name)."""
    ticks: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        role = "loop" if task.name == str(pid) else name
        ticks[role] = ticks.get(role, 0) + int(fields[11]) + int(fields[12])
    return ticks


def command(kind: str, port: int, env: dict[str, str]) -> tuple[list[str], dict[str, str], str]:
    if kind == "hub-uvicorn":
        return uvicorn(port), env, "/realtime/"
    if kind == "hub-daphne":
        return daphne(port), env, "/realtime/"
    if kind == "bare-uvicorn":
        cmd = uvicorn(port)
        return [*cmd[:-1], "bench.idle_process:bare_app"], {}, "/"
    return [sys.executable, "bench/ws_broadcast.py", str(port), "3600000"], {}, "/"


async def measure(kind: str, seconds: float, settle: float, env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    cmd, server_env, path = command(kind, port, env)
    with processes([cmd], [port], server_env) as procs:
        pid = procs[0].pid
        ws = await open_ws(f"ws://127.0.0.1:{port}{path}")
        try:
            await asyncio.sleep(settle)  # the hub's start, a first probe, the caches warm
            before, start = thread_ticks(pid), time.monotonic()
            left = seconds
            while left > 0:
                await asyncio.sleep(min(left, 10))
                left = seconds - (time.monotonic() - start)
                progress(f"{kind}: {seconds - max(left, 0):.0f}/{seconds:.0f} s")
            after, elapsed = thread_ticks(pid), time.monotonic() - start
        finally:
            await ws.close()
    per_thread = {
        role: round(100 * (ticks - before.get(role, 0)) * CLOCK_TICK_S / elapsed, 3) for role, ticks in after.items()
    }
    per_thread = {role: share for role, share in per_thread.items() if share}
    return {"kind": kind, "seconds": round(elapsed, 1), "core_pct": round(sum(per_thread.values()), 3), **per_thread}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--settle", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    url, prefix, env = redis_site()
    results = []
    try:
        for round_ in range(args.rounds):
            for kind in args.kinds:
                result = {"round": round_ + 1, **await measure(kind, args.seconds, args.settle, env)}
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        drop_keys(url, prefix)
    rounds = " ".join(f"{'round ' + str(r + 1):>9}" for r in range(args.rounds))
    print(f"\n{'server':<14} {rounds}  (% of a core)")
    for kind in args.kinds:
        shares = [r["core_pct"] for r in results if r["kind"] == kind]
        print(f"{kind:<14} " + " ".join(f"{share:>9.3f}" for share in shares))
    tick = CLOCK_TICK_S / args.seconds * 100
    print(f"(clock tick {CLOCK_TICK_S * 1000:.0f} ms: over {args.seconds:.0f} s one tick is {tick:.3f} % of a core)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
