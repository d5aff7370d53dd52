"""Admission: what a decision costs, and what it buys a server that abusive clients attack.

(a) The pure core: microseconds per decision (``Admission.admit`` + ``release``) over many
    identities, and per refusal.

(b) In one run, on fresh daphne processes of the demo site, a phase ``idle`` (``--polite``
    well-behaved clients ping every 100 ms, nobody else) and, for each attacker, a phase
    ``on`` (admission with the defaults) and ``off`` (every cap, bucket, per-address limit
    and error cost off, a pool as large as the flood). The attackers run in a process of
    their own, all from one address (``--attack-address``), the well-behaved clients each
    from its own (a trusted proxy header, ``TRUSTED_PROXIES = ["127.0.0.1"]``):

* ``sleepers`` — ``--abusers`` sockets each keeping ``--window`` ``demo.sleep {ms}``
  outstanding, sending again as soon as one is answered (refused or not), reconnecting a
  second after the server closes them;
* ``churn``    — sockets that send 10 ``demo.sleep 2000`` and leave after 0-300 ms (half
  abort the TCP socket), 40 at a time;
* ``unknown``  — sockets sending batches of 50 calls of an unknown method as fast as they
  can, reconnecting a second after a close;
* ``resume``   — 10 sockets resuming a history of 1,000 events of 60 KB (on a private
  Redis, filled first) ``since`` its start, again and again; the phase also reports the
  longest command in Redis' slow log;
* ``addresses`` — many addresses (``--addresses``, 40) each opening up to 50 sockets and
  holding them, opening again a second after the server closes one: the process ceiling
  (``MAX_CONNECTIONS``, 1,000 here, with its signed-in reserve) against per-address caps
  alone;
* ``nesting``  — frames whose params nest 500 levels deep around a lone surrogate, as fast
  as the socket takes them (on: refused ``too_deep`` by an iterative scan; there is no
  "off" for it: the off phase shows the same server);
* ``slowcalls`` — ten addresses each keeping 10 ``demo.sleep 5000`` outstanding: their
  class's share of the pool against fairness among identities alone;
* ``resumehog`` — one address pipelining resumes of the large history into sockets it
  never reads: ``MAX_RESUMES_PER_IDENTITY`` against the process's resume slots alone;
* ``tickers``  — 10 idle sockets of one address subscribing lot cadences
  (``demo:lot:<n>:<ms>``), 8 a second each, holding what they get: each identity's share
  of the tickers (``MAX_TICKERS_PER_IDENTITY``) against the process's pool alone;
* ``rooms``    — 40 addresses, 5 idle sockets each, subscribing fresh presence rooms
  (``demo:room:<slug>``) and holding them: shares of instances and the backplane bytes
  of fresh rooms, and the upkeep of idle rooms;
* ``keyless``  — 8 loops of ``POST /realtime/api/publish`` without a key, back to back:
  the key checked before Django's middleware (``MetricsShortcut``) and the address's
  failure bucket;
* ``badtokens`` — handshakes with a bad Bearer token, back to back: each draws on its
  address's handshake bucket.

Beside the anonymous well-behaved pingers, a **signed-in user** calls ``demo.echo`` (a pool
method, unlike ping) every 100 ms, and signs in again on a new socket every 2 s (its
handshake too must get through), subscribing there ``demo:lot:7`` and a new
``demo:clock`` cadence (a refused subscribe is a failure: what the ticker attack took).

It prints, per phase: well-behaved ping p50/p99 and p99 over ``idle``'s, the signed-in
user's call p99 and how many of its calls and handshakes failed, what the attackers got
done and refused, how often the server closed them, the server's peak RSS and, for the
resume attacks, Redis' longest command.

Usage: python bench/admission.py [--seconds 15]
       [--attacks sleepers,churn,unknown,resume,addresses,nesting,slowcalls,resumehog,
                  tickers,rooms,keyless,badtokens]
       [--abusers 100] [--addresses 200] [--polite 20] [--sleep-ms 200] [--window 50]
       [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets

from bench.common import ROOT, daphne, free_port, percentile, prepare_database, processes, progress, rss_bytes

MIB = 1024 * 1024
ON = {  # the defaults, with the clients' addresses read from the bench's header
    "TRUSTED_PROXIES": ["127.0.0.1"],
    "MAX_CONNECTIONS_PER_ADDRESS": 50,
    "HANDSHAKES_PER_S": 10.0,
    "MAX_CONNECTIONS": 1000,  # a ceiling a bench of a few thousand sockets reaches (10,000 by default)
}
OFF = {
    "TRUSTED_PROXIES": ["127.0.0.1"],
    "ADMISSION_MAX_PENDING": 0,
    "ADMISSION_MAX_PER_IDENTITY": 0,
    "ADMISSION_BUCKET_CAPACITY": 0,
    "ADMISSION_MAX_RUNNING": 100000,
    "ADMISSION_CLOSE_AFTER_REFUSALS": 0,
    "ADMISSION_ERROR_COST": 0,
    "MAX_CONNECTIONS_PER_ADDRESS": 0,
    "HANDSHAKES_PER_S": 0,
    "MAX_CONCURRENT_RESUMES": 0,
    "MAX_RESUMES_PER_IDENTITY": 0,
    "MAX_CONNECTIONS": 0,
    "SIGNED_IN_RESERVE": 0.0,
    "MAX_ANONYMOUS_HANDSHAKES_PER_S": 0,
    "MAX_TICKERS_PER_IDENTITY": 0,
    "MAX_INSTANCES_PER_IDENTITY": 0,
    "MAX_BACKPLANE_BYTES_PER_IDENTITY": 0,
    "MAX_CADENCES_PER_FAMILY": 0,
}
OFF_KEEPING_THE_POOL = {**OFF, "ADMISSION_MAX_RUNNING": 64}  # slowcalls: the pool's share is what is measured
ATTACKS = (
    "sleepers",
    "churn",
    "unknown",
    "resume",
    "addresses",
    "nesting",
    "slowcalls",
    "resumehog",
    "tickers",
    "rooms",
    "keyless",
    "badtokens",
)
RESUMES = ("resume", "resumehog")
HISTORY = "bench:big-history"


def decision_cost(n: int = 200_000) -> dict[str, float]:
    """µs per admitted decision (admit + release) and per refusal, of the pure core."""
    from realtime_app.inbound.admission import Admission, AdmissionLimits

    admission = Admission(AdmissionLimits())
    identities = [("connection", str(i)) for i in range(1000)]
    started = time.perf_counter()
    for i in range(n):
        identity = identities[i % 1000]
        if admission.admit(identity, 0.25) is None:
            admission.release(identity)
    admitted_us = (time.perf_counter() - started) / n * 1e6
    empty = Admission(AdmissionLimits(refill_per_s=0.001, bucket_capacity=1))
    empty.admit("x", 1)
    started = time.perf_counter()
    for _ in range(n):
        empty.admit("x", 1)
    refused_us = (time.perf_counter() - started) / n * 1e6
    return {"admitted_us": admitted_us, "refused_us": refused_us}


def connect(url: str, address: str, **kwargs: Any) -> Any:
    origin = url.replace("ws://", "http://").split("/realtime")[0]
    return websockets.connect(url, origin=origin, additional_headers={"X-Forwarded-For": address}, **kwargs)


async def polite(url: str, n: int, stop: asyncio.Event, latencies: list[float]) -> None:
    async with connect(url, f"10.1.{n // 256}.{n % 256}") as ws:
        ids = itertools.count()
        while not stop.is_set():
            request_id = next(ids)
            started = time.perf_counter()
            await ws.send(json.dumps({"jsonrpc": "2.0", "method": "ping", "id": request_id}))
            while json.loads(await ws.recv()).get("id") != request_id:
                pass
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.1)


def count(stats: dict[str, Any], answer: dict[str, Any]) -> None:
    if "error" in answer and answer["error"]["code"] in (-32003, -32004, -32005):
        stats["refused"] += 1
    else:
        stats["completed"] += 1


def sleep_request(ids: Iterator[int], params: dict[str, Any]) -> str:
    return json.dumps({"jsonrpc": "2.0", "method": "demo.sleep", "params": params, "id": next(ids)})


async def keep_sleeping(
    url: str, address: str, ms: int, window: int, stop: asyncio.Event, stats: dict[str, Any]
) -> None:
    """Keeps ``window`` ``demo.sleep {ms}`` requests outstanding from ``address``, sending
    again as soon as one is answered — refused or not; closed by the server, it connects
    again a second later."""
    while not stop.is_set():
        try:
            async with connect(url, address, max_queue=None) as ws:
                request = functools.partial(sleep_request, itertools.count(), {"ms": ms})
                for _ in range(window):
                    await ws.send(request())
                while not stop.is_set():
                    try:
                        answer = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                    except TimeoutError:
                        continue
                    count(stats, answer)
                    await ws.send(request())
        except (OSError, websockets.WebSocketException):
            stats["closed"] += 1
        if not stop.is_set():
            await asyncio.sleep(1.0)


async def sleepers(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """One of the sleepers, all from the attacking address."""
    await keep_sleeping(url, args.attack_address, args.sleep_ms, args.window, stop, stats)


async def churn(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Sends 10 demo.sleep and leaves after 0-300 ms, half of the time aborting the socket."""
    rounds = itertools.count()
    batch = json.dumps([{"jsonrpc": "2.0", "method": "demo.sleep", "params": {"ms": 2000}, "id": i} for i in range(10)])
    while not stop.is_set():
        try:
            ws = await connect(url, args.attack_address, open_timeout=5)
            await ws.send(batch)
            stats["completed"] += 10
            await asyncio.sleep(random.uniform(0, 0.3))
            if next(rounds) % 2:
                ws.transport.abort()
            else:
                await ws.close()
        except (OSError, TimeoutError, websockets.WebSocketException):
            stats["closed"] += 1
            await asyncio.sleep(0.1)


async def unknown(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Batches of 50 calls of a method that does not exist, as fast as the socket takes them."""
    batch = json.dumps([{"jsonrpc": "2.0", "method": "no.such.method", "id": i} for i in range(50)])
    while not stop.is_set():
        try:
            async with connect(url, args.attack_address, max_queue=None) as ws:

                async def drain() -> None:
                    async for text in ws:
                        for answer in json.loads(text):
                            count(stats, answer)

                reader = asyncio.create_task(drain())
                try:
                    while not stop.is_set():
                        await ws.send(batch)
                        await asyncio.sleep(0)
                finally:
                    reader.cancel()
        except (OSError, websockets.WebSocketException):
            stats["closed"] += 1
        if not stop.is_set():
            await asyncio.sleep(1.0)


async def resume(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Subscribes ``since`` the start of a large history, reads the replay, and again."""
    since = json.loads(args.since)
    request = {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": HISTORY, "since": since}, "id": 1}
    while not stop.is_set():
        try:
            async with connect(url, args.attack_address, max_size=None, max_queue=None) as ws:
                await ws.send(json.dumps(request))
                while not stop.is_set():
                    answer = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    if answer.get("id") == 1:
                        count(stats, answer)
                        if "error" in answer:
                            await asyncio.sleep(answer["error"]["data"].get("retry_after_ms", 1000) / 1000)
                        break
                    stats["replayed"] += 1
        except (OSError, TimeoutError, websockets.WebSocketException):
            stats["closed"] += 1


async def addresses(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """One address of ``--addresses``: opens up to 50 sockets and holds them, opening
    again as the server closes them."""
    n = stats.setdefault("_next", 0)
    stats["_next"] = n + 1
    address = f"198.18.{n // 256}.{n % 256}"
    held: list[Any] = []
    while not stop.is_set():
        closed = [ws for ws in held if ws.close_code is not None]
        held = [ws for ws in held if ws.close_code is None]
        if closed:  # closed by the server: open again a second later, as the other attackers do
            stats["closed"] += len(closed)
            await asyncio.sleep(1.0)
        if len(held) < 50:
            try:
                ws = await connect(url, address, max_queue=None).__aenter__()
                held.append(ws)
                stats["completed"] += 1
            except (OSError, websockets.WebSocketException):
                stats["refused"] += 1
                await asyncio.sleep(0.5)
        else:
            await asyncio.sleep(0.2)
    for ws in held:
        with contextlib.suppress(Exception):
            await ws.close()


async def nesting(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Frames of params nested 500 deep around a lone surrogate, as fast as they go."""
    deep = "[" * 500 + '"\\ud800"' + "]" * 500
    while not stop.is_set():
        try:
            async with connect(url, args.attack_address, max_queue=None) as ws:
                for i in itertools.count():
                    if stop.is_set():
                        break
                    await ws.send(f'{{"jsonrpc":"2.0","method":"demo.echo","id":{i},"params":{deep}}}')
                    answer = json.loads(await ws.recv())
                    stats["refused" if "error" in answer else "completed"] += 1
        except (OSError, websockets.WebSocketException):
            stats["closed"] += 1
            await asyncio.sleep(0.2)


async def slowcalls(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """One address of ten: keeps 10 ``demo.sleep 5000`` outstanding."""
    n = stats.setdefault("_next", 0)
    stats["_next"] = n + 1
    await keep_sleeping(url, f"198.19.0.{n}", 5000, 10, stop, stats)


async def signed_in(
    url: str, cookie: str, stop: asyncio.Event, latencies: list[float], failures: dict[str, int]
) -> None:
    """A signed-in user: ``demo.echo`` (a pool method) every 100 ms, on a new socket every
    2 s (its handshake must get through too); a call or handshake that fails is counted."""
    origin = url.replace("ws://", "http://").split("/realtime")[0]
    ids = itertools.count()
    while not stop.is_set():
        try:
            async with websockets.connect(url, origin=origin, additional_headers={"Cookie": cookie}) as ws:
                for channel in ("demo:lot:7", f"demo:clock:{random.randint(100, 60000)}"):  # what tickers take
                    request_id = next(ids)
                    params = {"channel": channel}
                    await ws.send(
                        json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": params, "id": request_id})
                    )
                    while (answer := json.loads(await asyncio.wait_for(ws.recv(), 30))).get("id") != request_id:
                        pass
                    if "error" in answer:
                        failures["subscribes"] += 1
                until = time.monotonic() + 2
                while not stop.is_set() and time.monotonic() < until:
                    request_id = next(ids)
                    started = time.perf_counter()
                    request = {"jsonrpc": "2.0", "method": "demo.echo", "params": {"text": "x"}, "id": request_id}
                    await ws.send(json.dumps(request))
                    while (answer := json.loads(await asyncio.wait_for(ws.recv(), 30))).get("id") != request_id:
                        pass
                    if "result" in answer:
                        latencies.append((time.perf_counter() - started) * 1000)
                    else:
                        failures["calls"] += 1
                    await asyncio.sleep(0.1)
        except (OSError, TimeoutError, websockets.WebSocketException):
            failures["handshakes"] += 1
            await asyncio.sleep(0.5)


async def resumehog(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Pipelines resumes of the large history into a socket it never reads."""
    since = json.loads(args.since)
    while not stop.is_set():
        try:
            async with connect(url, args.attack_address, max_size=None, max_queue=1) as ws:
                ws.transport.pause_reading()
                for i in range(20):
                    request = {"channel": HISTORY, "since": since}
                    await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": request, "id": i}))
                    stats["completed"] += 1
                await asyncio.wait_for(stop.wait(), args.seconds)
        except (OSError, TimeoutError, websockets.WebSocketException):
            stats["closed"] += 1


async def hold_subscribing(
    url: str, address: str, names: Iterator[str], per_s: float, stop: asyncio.Event, stats: dict[str, Any]
) -> None:
    """An idle socket of ``address`` subscribing ``names`` at ``per_s`` and holding them."""
    ids = itertools.count()
    while not stop.is_set():
        try:
            async with connect(url, address, max_queue=None) as ws:

                async def read() -> None:
                    async for text in ws:
                        answer = json.loads(text)
                        if isinstance(answer, dict) and "id" in answer:
                            count(stats, answer)

                reader = asyncio.create_task(read())
                try:
                    while not stop.is_set():
                        params = {"channel": next(names)}
                        await ws.send(
                            json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": params, "id": next(ids)})
                        )
                        await asyncio.sleep(1 / per_s)
                finally:
                    reader.cancel()
        except (OSError, websockets.WebSocketException):
            stats["closed"] += 1
        if not stop.is_set():
            await asyncio.sleep(1.0)


async def tickers(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """One of 10 sockets of the attacking address: lot cadences, 8 a second."""
    n = stats.setdefault("_next", 0)
    stats["_next"] = n + 1
    names = (f"demo:lot:{lot}:{ms}" for lot in itertools.count(1 + n * 100) for ms in (250, 500, 750, 1500, 3000))
    await hold_subscribing(url, args.attack_address, names, 8.0, stop, stats)


async def rooms(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """One of 200 sockets of 40 addresses: fresh presence rooms, 8 a second."""
    n = stats.setdefault("_next", 0)
    stats["_next"] = n + 1
    names = (f"demo:room:r{n}-{i}" for i in itertools.count())
    await hold_subscribing(url, f"198.18.1.{n // 5}", names, 8.0, stop, stats)


async def keyless(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """POSTs to the publish API without a key, back to back, on one kept-alive connection."""
    port = int(url.split(":")[2].split("/")[0])
    body = b'{"channel": "demo:events", "data": 1}'
    head = (
        "POST /realtime/api/publish HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nX-Forwarded-For: {args.attack_address}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while not stop.is_set():
                    writer.write(head + body)
                    status = (await reader.readline()).split(b" ")[1]
                    length = 0
                    while (line := await reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    await reader.readexactly(length)
                    stats["refused" if status in (b"401", b"429") else "completed"] += 1
            finally:
                writer.close()
        except (OSError, IndexError, ValueError, asyncio.IncompleteReadError):
            stats["closed"] += 1
            await asyncio.sleep(0.1)


async def badtokens(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Handshakes with a bad Bearer token, back to back."""
    headers = {"X-Forwarded-For": args.attack_address, "Authorization": "Bearer not-a-token"}
    while not stop.is_set():
        try:
            async with websockets.connect(url, additional_headers=headers, open_timeout=5) as ws:
                await asyncio.wait_for(ws.recv(), 5)
        except websockets.ConnectionClosed as closed:
            stats["refused" if closed.rcvd and closed.rcvd.code == 1013 else "completed"] += 1
        except (OSError, TimeoutError, websockets.WebSocketException):
            stats["closed"] += 1
            await asyncio.sleep(0.05)


async def attackers_main(args: argparse.Namespace) -> None:
    """``--role attackers``: the attack in a process of its own (so that its event loop does
    not delay the well-behaved clients' measurements); prints its stats."""
    stop = asyncio.Event()
    stats: dict[str, Any] = {"completed": 0, "refused": 0, "closed": 0, "replayed": 0}
    attack = {
        "sleepers": sleepers,
        "churn": churn,
        "unknown": unknown,
        "resume": resume,
        "addresses": addresses,
        "nesting": nesting,
        "slowcalls": slowcalls,
        "resumehog": resumehog,
        "tickers": tickers,
        "rooms": rooms,
        "keyless": keyless,
        "badtokens": badtokens,
    }[args.kind]
    n = {
        "sleepers": args.abusers,
        "churn": 40,
        "unknown": 2,
        "resume": 10,
        "addresses": args.addresses,
        "nesting": 2,
        "slowcalls": 10,
        "resumehog": 8,
        "tickers": 10,
        "rooms": 200,
        "keyless": 8,
        "badtokens": 4,
    }[args.kind]
    tasks = [asyncio.create_task(attack(args.url, stop, args, stats)) for _ in range(n)]
    await asyncio.sleep(args.seconds)
    stop.set()
    await asyncio.wait(tasks, timeout=10)
    for task in tasks:
        task.cancel()
    stats.pop("_next", None)
    print(json.dumps(stats), flush=True)


async def phase(
    name: str, kind: str | None, env: dict[str, str], args: argparse.Namespace, redis_url: str | None = None
) -> dict[str, Any]:
    port = free_port()
    url = f"ws://127.0.0.1:{port}/realtime/"
    slowlog = None
    if redis_url:
        import redis

        slowlog = redis.Redis.from_url(redis_url)
        slowlog.config_set("slowlog-log-slower-than", 1000)  # µs
        slowlog.slowlog_reset()
    with processes([daphne(port)], [port], env) as procs:
        pid = procs[0].pid
        stop = asyncio.Event()
        latencies: list[float] = []
        attack = None
        if kind is not None:
            attack = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--role", "attackers", "--kind", kind, "--url", url,
                "--abusers", str(args.abusers), "--seconds", str(args.seconds + 1.0), "--sleep-ms", str(args.sleep_ms),
                "--window", str(args.window), "--attack-address", args.attack_address, "--since", args.since,
                "--addresses", str(args.addresses),
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            await asyncio.sleep(1.0)
        tasks = [asyncio.create_task(polite(url, n, stop, latencies)) for n in range(args.polite)]
        from tests.support.servers import login

        cookie = await asyncio.to_thread(login, f"http://127.0.0.1:{port}", "demo", "demo")
        user_latencies: list[float] = []
        failures = {"calls": 0, "handshakes": 0, "subscribes": 0}
        tasks.append(asyncio.create_task(signed_in(url, cookie, stop, user_latencies, failures)))
        peak = 0
        t0 = time.monotonic()
        series: list[tuple[float, int]] = []
        while (elapsed := time.monotonic() - t0) < args.seconds:
            rss = rss_bytes(pid)
            peak = max(peak, rss)
            series.append((elapsed, rss))
            if len(series) % 10 == 0:
                progress(f"{name}: {elapsed:.0f}/{args.seconds:.0f} s, RSS {rss / MIB:.0f} MiB")
            await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        stats: dict[str, Any] = {"completed": 0, "refused": 0, "closed": 0, "replayed": 0}
        if attack is not None:
            out, _ = await attack.communicate()
            stats = json.loads(out.decode().strip().splitlines()[-1])
    longest = max((entry["duration"] for entry in slowlog.slowlog_get(1000)), default=0) if slowlog else None
    return {
        "phase": name,
        "attack": kind or "",
        "ping_p50_ms": percentile(latencies, 50),
        "ping_p99_ms": percentile(latencies, 99),
        "pings": len(latencies),
        "user_p99_ms": percentile(user_latencies, 99) if user_latencies else float("nan"),
        "user_failed": failures["calls"] + failures["handshakes"],
        "user_subscribes_refused": failures["subscribes"],
        **stats,
        "redis_longest_ms": None if longest is None else longest / 1000,
        "rss_start_mib": series[0][1] / MIB,
        "rss_peak_mib": peak / MIB,
        "series": series,
    }


def fill_history(redis_url: str, prefix: str) -> str:
    """1,000 events of 60 KB on the resumers' channel; returns their ``since``."""
    code = (
        "import asyncio, json, django; django.setup(); import bench.asgi\n"
        "from realtime_app.hub import get_hub\n"
        "async def main():\n"
        "    hub = await get_hub()\n"
        "    pad = 'x' * 60000\n"
        f"    seqs = [await hub.publish('{HISTORY}', {{'i': i, 'pad': pad}}) for i in range(1000)]\n"
        f"    read = await hub.backplane.history('{HISTORY}', bench.asgi.registry.resolve('{HISTORY}').history)\n"
        "    await hub.aclose()\n"
        "    print(json.dumps({'seq': seqs[0] - 1, 'epoch': read.epoch}))\n"
        "asyncio.run(main())\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REDIS_URL": redis_url,
        "REALTIME_KEY_PREFIX": prefix,
    }
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = [row["attack"] for row in results if row["phase"] == "on"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    xs = range(len(attacks))
    for ax, field, label in (
        (axes[0], "ping_p99_ms", "well-behaved ping p99, ms (log)"),
        (axes[1], "user_p99_ms", "signed-in user's call p99, ms (log)"),
    ):
        idle = results[0][field]
        on = [next(r[field] for r in results if r["attack"] == a and r["phase"] == "on") for a in attacks]
        off = [next(r[field] for r in results if r["attack"] == a and r["phase"] == "off") for a in attacks]
        ax.bar([x - 0.2 for x in xs], on, width=0.4, label="protection on", color="#2a7")
        ax.bar([x + 0.2 for x in xs], off, width=0.4, label="protection off", color="#c33")
        ax.axhline(idle, color="#888", linestyle="--", label=f"idle ({idle:.1f} ms)")
        ax.set_xticks(list(xs), attacks, rotation=30)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument(
        "--attacks", default=",".join(ATTACKS), help="a comma-separated subset of " + ", ".join(ATTACKS)
    )
    parser.add_argument("--abusers", type=int, default=100)
    parser.add_argument("--addresses", type=int, default=40)
    parser.add_argument("--polite", type=int, default=20)
    parser.add_argument("--sleep-ms", type=int, default=200)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--attack-address", default="203.0.113.1")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--role", choices=["bench", "attackers"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=ATTACKS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--since", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "attackers":
        await attackers_main(args)
        return
    os.chdir(ROOT)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown_attacks = set(attacks) - set(ATTACKS)
    if unknown_attacks:
        parser.error(f"unknown attacks: {', '.join(sorted(unknown_attacks))}")

    cost = decision_cost()
    print(
        f"pure core: {cost['admitted_us']:.2f} µs per admitted decision (admit + release), "
        f"{cost['refused_us']:.2f} µs per refusal"
    )
    db = prepare_database(str(Path(tempfile.mkdtemp()) / "db.sqlite3"))
    base = {**db, "REDIS_URL": "", "DJANGO_SETTINGS_MODULE": "bench.settings", "REALTIME_LOG_LEVEL": "ERROR"}
    on = {**base, "REALTIME_BENCH_OVERRIDES": json.dumps(ON)}
    off = {**base, "REALTIME_BENCH_OVERRIDES": json.dumps(OFF)}
    results = [await phase("idle", None, on, args)]
    redis_server = None
    try:
        for kind in attacks:
            redis_url = None
            phase_on, phase_off = on, off
            if kind in RESUMES:
                from tests.support.private_redis import PrivateRedis

                if redis_server is not None:  # one private Redis at a time: the last one's history is not reused
                    redis_server.close()
                redis_server = PrivateRedis().start()
                redis_url = redis_server.url
                progress("resume: filling a history of 1,000 events of 60 KB")
                args.since = fill_history(redis_url, "bench-admission")
                extra = {"REDIS_URL": redis_url, "REALTIME_KEY_PREFIX": "bench-admission"}
                phase_on, phase_off = {**on, **extra}, {**off, **extra}
            results.append(await phase("on", kind, phase_on, args, redis_url))
            if kind == "slowcalls":  # the pool as by default: its anonymous share is what is off
                phase_off = {**phase_off, "REALTIME_BENCH_OVERRIDES": json.dumps(OFF_KEEPING_THE_POOL)}
            results.append(await phase("off", kind, phase_off, args, redis_url))
    finally:
        if redis_server is not None:
            redis_server.close()
    idle_p99, idle_user_p99 = results[0]["ping_p99_ms"], results[0]["user_p99_ms"]
    print(
        f"\n{args.polite} well-behaved clients pinging every 100 ms, each from its own address; the attackers "
        f"from one; {args.seconds:.0f} s per phase"
    )
    print(
        f"{'attack':<10}{'phase':<6}{'ping p50':>9}{'p99 ms':>8}{'p99/idle':>9}{'user p99':>9}{'/idle':>7}"
        f"{'failed':>7}{'subs refused':>13}"
        f"{'done':>9}{'refused':>9}{'closed':>8}{'RSS peak MiB':>13}{'Redis max ms':>13}"
    )
    for row in results:
        longest = "" if row["redis_longest_ms"] is None else f"{row['redis_longest_ms']:.1f}"
        print(
            f"{row['attack'] or '-':<10}{row['phase']:<6}{row['ping_p50_ms']:>9.1f}{row['ping_p99_ms']:>8.1f}"
            f"{row['ping_p99_ms'] / idle_p99:>9.2f}{row['user_p99_ms']:>9.1f}"
            f"{row['user_p99_ms'] / idle_user_p99:>7.2f}{row['user_failed']:>7}{row['user_subscribes_refused']:>13}"
            f"{row['completed']:>9}{row['refused']:>9}{row['closed']:>8}"
            f"{row['rss_peak_mib']:>13.0f}{longest:>13}"
        )
    if args.json:
        args.json.write_text(json.dumps({"decision": cost, "phases": results}, indent=2))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    asyncio.run(main())
