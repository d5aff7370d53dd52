"""Channels used by the tests: their factories record starts and cleanups.

In a daphne process on Redis (REDIS_URL set) the events go to the Redis list
``<KEY_PREFIX>:test-events`` so the test can read what every process did; in-process
they go to :data:`EVENTS`.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import realtime_app
from realtime_app.declarations.registry import ChannelSpec
from realtime_app.exceptions import RPCError

EVENTS: list[tuple[str, str]] = []


def record(kind: str, channel: str) -> None:
    EVENTS.append((kind, channel))
    url = os.environ.get("REDIS_URL")
    if url:
        import redis

        prefix = os.environ.get("REALTIME_KEY_PREFIX", "realtime")
        client = redis.Redis.from_url(url.split(",")[0])  # the first, when there are shards
        client.rpush(f"{prefix}:test-events", json.dumps([kind, channel, os.getpid()]))
        client.close()


@realtime_app.family("test:counter", default=1000, min=50, max=60000)
def counter(channel: ChannelSpec, publish: Any) -> Any:
    record("start", channel.name)

    async def run() -> None:
        n = 0
        while True:
            n += 1
            publish({"n": n})
            await asyncio.sleep(channel.interval_ms / 1000)  # type: ignore[operator]

    task = asyncio.get_running_loop().create_task(run())

    def cleanup() -> None:
        task.cancel()
        record("cleanup", channel.name)

    return cleanup


@realtime_app.family("test:staff", default=1000, min=100, max=60000)
def staff_only(channel: ChannelSpec, publish: Any) -> None:
    return None


@realtime_app.family("test:perm", default=1000, min=100, max=60000)
def perm_only(channel: ChannelSpec, publish: Any) -> None:
    return None


@realtime_app.ticker("test:failing-tick", default=1000, min=100, max=60000)
def failing_tick(channel: ChannelSpec) -> Any:
    return {"load": measure_load()}  # type: ignore[name-defined]  # noqa: F821  (the Quick start's old slip)


@realtime_app.family("test:broken", default=1000, min=100, max=60000)
def broken(channel: ChannelSpec, publish: Any) -> None:
    raise RuntimeError("this factory always fails")


_drift = {"n": 0}


@realtime_app.ticker("test:drift", default=100, min=10, max=60000)
def drift(channel: ChannelSpec) -> dict[str, Any]:
    """A state worth deltas: 2 KiB that stay, 200 random characters and a counter new in
    each frame (a delta of about 250 bytes beside a 2.3 KiB full frame)."""
    _drift["n"] += 1
    return {"n": _drift["n"], "fixed": "abcdefgh" * 256, "fresh": os.urandom(100).hex()}


realtime_app.event_channel("test:events")
realtime_app.event_channel("test:short-history", history_size=5, history_ttl_s=60)
realtime_app.event_channel("test:big-history", history_size=1000, history_ttl_s=300)
realtime_app.event_channel("test:durable", history_size=1000, history_ttl_s=300, durable=True)
for _n in range(24):  # channels with history that land on every shard of a sharded backplane
    realtime_app.event_channel(f"test:kept-{_n}", history_size=100, history_ttl_s=300)


@realtime_app.rpc_method("test.echo")
def echo(consumer: Any, params: Any) -> Any:
    return params


@realtime_app.rpc_method("test.crash")
def crash(consumer: Any, params: Any) -> Any:
    raise ZeroDivisionError("deliberate")


@realtime_app.rpc_method("test.close")
async def close_with(consumer: Any, params: Any) -> None:
    """Close this connection with the code asked (for reconnect tests)."""
    await consumer.close(int(params["code"]), "test")


@realtime_app.rpc_method("test.sleep")
async def sleep_for(consumer: Any, params: Any) -> str:
    await asyncio.sleep(float(params["seconds"]))
    return "slept"


@realtime_app.rpc_method("test.costly", cost=6, snapshot=lambda consumer: {"who": consumer.admission_identity()[0]})
def costly(consumer: Any, params: Any) -> str:
    return "done"


#: Concurrency seen inside ``test.hold``: the pool's bound, measured where the work runs.
holding = {"now": 0, "max": 0, "order": []}


@realtime_app.rpc_method("test.hold")
async def hold(consumer: Any, params: Any) -> int:
    """Stay inside for ``seconds``, counting how many calls are inside at once."""
    holding["now"] += 1
    holding["max"] = max(holding["max"], holding["now"])
    holding["order"].append(params.get("tag"))
    try:
        await asyncio.sleep(float(params["seconds"]))
    finally:
        holding["now"] -= 1
    return holding["max"]


@realtime_app.rpc_method("test.thread")
def on_thread(consumer: Any, params: Any) -> dict[str, Any]:
    """A sync handler: where it runs (never on the event loop's thread)."""
    import threading

    try:
        asyncio.get_running_loop()
        on_loop = True
    except RuntimeError:
        on_loop = False
    return {"on_loop": on_loop, "thread": threading.current_thread().name}


@realtime_app.rpc_method("test.model_values")
def model_values(consumer: Any, params: Any) -> dict[str, Any]:
    """What a model hands out: a Decimal, an aware datetime, a UUID (a sync handler)."""
    import datetime
    import decimal
    import uuid

    return {
        "price": decimal.Decimal("19.90"),
        "at": datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    }


@realtime_app.rpc_method("test.unencodable")
async def unencodable(consumer: Any, params: Any) -> Any:
    """A result no JSON encoder knows (async), or one JSON cannot carry (``nan``)."""
    return float("nan") if isinstance(params, dict) and params.get("nan") else {"obj": object()}


@realtime_app.rpc_method("test.unencodable_sync")
def unencodable_sync(consumer: Any, params: Any) -> Any:
    return {"set": {1, 2}}


@realtime_app.rpc_method(
    "test.merge_unencodable",
    coalesce=realtime_app.Coalesce(
        key=lambda identity, params: identity,
        units=lambda params: 1,
        merge=lambda all_params: all_params,
        cap=100,
        answer=lambda result, params, units, requests: {"obj": object()} if requests > 1 else result,
        serial=True,
    ),
)
async def merge_unencodable(consumer: Any, params: Any) -> str:
    """Merged callers get an answer their ``answer()`` cannot encode."""
    await asyncio.sleep(0.05)
    return "ok"


@realtime_app.state_channel("test:state-conflated")
def state_conflated(channel: ChannelSpec, publish: Any) -> None:
    """Published by ``test.publish_burst`` (its ``POLICIES`` rule conflates it in the test)."""
    return None


@realtime_app.state_channel("test:state-dropped")
def state_dropped(channel: ChannelSpec, publish: Any) -> None:
    return None


@realtime_app.rpc_method("test.publish_burst")
async def publish_burst(consumer: Any, params: Any) -> int:
    """``count`` publications of ``size`` bytes on each of ``channels``, interleaved:
    ``{"n": i, "pad": ...}`` (``i`` from ``"start"``, 0), with ``"fresh"``: that many random
    hex characters more, new in each publication (a delta of that size); returns how many
    were published."""
    pad = "x" * int(params["size"])
    fresh = int(params.get("fresh", 0))
    start = int(params.get("start", 0))
    published = 0
    for i in range(start, start + int(params["count"])):
        for channel in params["channels"]:
            data = {"n": i, "pad": pad, **({"fresh": os.urandom(fresh // 2).hex()} if fresh else {})}
            await realtime_app.apublish(channel, data)
            published += 1
        await asyncio.sleep(0)
    return published


@realtime_app.rpc_method("test.one_at_a_time", max_in_flight=1)
async def one_at_a_time(consumer: Any, params: Any) -> str:
    """At most one call in flight per identity (``rpc_method(max_in_flight=1)``)."""
    await asyncio.sleep(float(params.get("seconds", 0)) if isinstance(params, dict) else 0)
    return "done"


@realtime_app.rpc_method("test.twice_a_second", rate=2.0, burst=2)
async def twice_a_second(consumer: Any, params: Any) -> str:
    """Two calls a second per identity, in bursts of two (``rpc_method(rate=2, burst=2)``)."""
    return "done"


# -- channels per object -------------------------------------------------------------

#: Lots that exist for ``test:lot:<int:id>``: its ``exists`` hook reads this (and counts calls).
LOTS = set(range(1, 101))
exists_calls: list[dict[str, Any]] = []


def lot_exists(params: dict[str, Any]) -> bool:
    exists_calls.append(dict(params))
    return params["id"] in LOTS


async def bids_exist(params: dict[str, Any]) -> bool:
    """An async hook (the lot's bids exist when the lot does)."""
    exists_calls.append(dict(params))
    return params["lot"] in LOTS


realtime_app.app_state("test:lot:<int:id>", default=1000, min=50, max=10000, exists=lot_exists, public=True)
realtime_app.event_channel("test:bids:<int:lot>", history_size=20, history_ttl_s=60, exists=bids_exist, public=True)
realtime_app.event_channel("test:feed:<int:id>", owner="id", public=True)
realtime_app.event_channel("test:secret:<slug:name>")


@realtime_app.ticker("test:room:<slug:name>:load", default=1000, min=50, max=60000, public=True)
def room_load(channel: ChannelSpec) -> dict[str, Any]:
    """Each instance and cadence its own counter; the first tick records the start."""
    n = _room_ticks[channel.name] = _room_ticks.get(channel.name, 0) + 1
    if n == 1:
        record("start", channel.name)
    return {"room": channel.params["name"], "n": n}


_room_ticks: dict[str, int] = {}


def secret_check(user: Any, channel: Any, action: str) -> bool:
    """Only a user whose username is the instance's ``name`` reads ``test:secret:<name>``."""
    return bool(getattr(user, "is_authenticated", False)) and channel.params["name"] == user.get_username()


def flaky_exists(params: dict[str, Any]) -> bool:
    """Raises for ``test:flaky:0`` (a hook whose database is down); the rest exist."""
    if params["id"] == 0:
        raise ConnectionError("the database is down")
    return True


realtime_app.event_channel("test:flaky:<int:id>", exists=flaky_exists, public=True)

#: The database connection each call of ``member_exists`` used (its thread's).
member_hook_connections: list[Any] = []


def member_exists(params: dict[str, Any]) -> bool:
    """A hook that asks the database, as a project's do (a user of that id exists)."""
    from django.contrib.auth import get_user_model
    from django.db import connections

    member_hook_connections.append(connections["default"])
    return bool(get_user_model().objects.filter(pk=params["id"]).exists())


realtime_app.event_channel("test:member:<int:id>", exists=member_exists, public=True)
# Presence (docs/presence.md): rooms per name, one whose members only staff may see, a
# cadenced family whose cadences share one room.
realtime_app.event_channel("test:room:<slug:name>", history_size=10, history_ttl_s=60, presence=True, public=True)
realtime_app.event_channel("test:backstage", presence=True)


@realtime_app.ticker("test:crowd", default=1000, min=100, max=5000, presence=True)
def crowd_tick(channel):
    return {"interval_ms": channel.interval_ms}


#: Runs of ``test.once`` by key: what a call that runs once ran.
once_runs: dict[str, int] = {}


@realtime_app.rpc_method("test.once", idempotent=True)
async def run_once(consumer: Any, params: Any) -> dict[str, Any]:
    """Count a run per ``idempotency_key``; ``seconds`` inside, ``pad`` bytes of answer,
    ``crash`` an internal error, ``refuse`` the method's own error."""
    key = str(params.get("idempotency_key"))
    once_runs[key] = once_runs.get(key, 0) + 1
    await asyncio.sleep(float(params.get("seconds", 0)))
    if params.get("crash"):
        raise ZeroDivisionError("deliberate")
    if params.get("refuse"):
        raise RPCError(-32000, "Refused by the method", "refused_by_method")
    return {"run": once_runs[key], "pad": "x" * int(params.get("pad", 0))}


@realtime_app.rpc_method("test.post_durable")
def post_durable(consumer: Any, params: Any) -> str:
    """One durable publication of ``test:durable`` in a transaction (``demo.post``'s shape)."""
    from django.db import transaction

    with transaction.atomic():
        realtime_app.publish("test:durable", {"text": params["text"]})
    return "posted"


@realtime_app.rpc_method("test.commit_and_die")
def commit_and_die(consumer: Any, params: Any) -> None:
    """Commit ``count`` durable publications of ``channel``, one transaction each, then
    SIGKILL this process at once: rows committed, their publication anyone's guess."""
    import signal

    from django.db import transaction

    for n in range(int(params["count"])):
        with transaction.atomic():
            realtime_app.publish(params["channel"], {"n": n})
    os.kill(os.getpid(), signal.SIGKILL)


def presence_info(user):
    """``PRESENCE_INFO`` in tests: a member's display name."""
    return {"name": user.first_name or user.get_username()}


@realtime_app.rpc_method("test.daphne_sweeps")
async def daphne_sweeps(consumer: Any, params: Any) -> dict[str, int] | None:
    """What daphne's sweeps visit in this process (``realtime_app.endpoint.sweeps``), with
    its ping interval; None where they are daphne's own."""
    from realtime_app.endpoint.sweeps import installed

    sweeps = installed()
    return None if sweeps is None else {**sweeps.counts(), "ping_interval": sweeps.server.ping_interval}
