"""ASGI app of the benchmarks: realtime_app at /realtime/, plain Channels at /baseline/."""

import json
import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()

from channels.generic.websocket import AsyncWebsocketConsumer  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from realtime_app.declarations.registry import registry  # noqa: E402
from realtime_app.routing import AuthMiddlewareStack, MetricsShortcut, websocket_urlpatterns  # noqa: E402

if "bench:events" not in registry.exact:  # demo:events without history, for bench/history.py
    registry.add_channel("bench:events", "event")
if "bench:big-history" not in registry.exact:  # 1,000 events of any size kept: bench/admission.py's resumers
    from realtime_app import event_channel

    event_channel("bench:big-history", history_size=1000, history_ttl_s=600)

if "bench:room:<int:id>" not in registry.templates:  # bench/supabase.py: echo channels and rooms of six
    from realtime_app import event_channel

    event_channel("bench:room:<int:id>", public=True, max_instances=100_000)

if "bench:dash" not in registry.families:  # bench/bandwidth.py's feeds
    import random
    from typing import Any

    from realtime_app import state_channel, ticker

    _dash_rng = random.Random(1)
    _dash = {f"field_{i}": {"value": round(i * 1.5, 2), "label": f"sensor {i}", "ok": True} for i in range(40)}

    @ticker("bench:dash", default=100, min=10, max=60000)
    def dash(channel: object) -> dict:
        """A 2.3 KiB dashboard state, three of its forty fields changed per publication."""
        for k in _dash_rng.sample(range(40), 3):
            _dash[f"field_{k}"]["value"] = round(_dash[f"field_{k}"]["value"] + _dash_rng.uniform(-1, 1), 2)
        return _dash

    _state = {"n": 0}

    def _big_state(channel: object) -> dict:
        """16 KiB of state and a counter: a slow reader's queue fills in a second."""
        _state["n"] += 1
        return {"n": _state["n"], "pad": "x" * 16384}

    ticker("bench:conflated", default=100, min=10, max=60000)(_big_state)  # its POLICIES rule: conflate
    ticker("bench:dropped", default=100, min=10, max=60000)(_big_state)

    def _bursts(channel: object, publish: Any) -> Any:
        """The same state at 10 Hz for 1.5 s of every 3.1 s: figures that change in spells."""
        import asyncio

        async def run() -> None:
            while True:
                for _ in range(15):
                    publish(_big_state(channel))
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.6)

        return asyncio.get_running_loop().create_task(run()).cancel

    state_channel("bench:burst-conflated")(_bursts)
    state_channel("bench:burst-dropped")(_bursts)

if os.environ.get("BENCH_DAPHNE_WRITE"):  # bench/fanout.py --daphne-write
    from realtime_app.outbound.daphne import DaphneTransport

    DaphneTransport.write_mode = os.environ["BENCH_DAPHNE_WRITE"]

BASELINE_GROUP = "bench-baseline"


class BaselineConsumer(AsyncWebsocketConsumer):
    """The plain Channels way: every connection joins the group; group_send reaches each."""

    async def connect(self) -> None:
        await self.channel_layer.group_add(BASELINE_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(BASELINE_GROUP, self.channel_name)

    async def bench_frame(self, event: dict) -> None:
        await self.send(text_data=event["text"])


if "bench:room:<int:id>" not in registry.templates:  # bench/instances.py: channels per object vs listed ones
    import asyncio as _asyncio

    from realtime_app import app_state, apublish, event_channel, rpc_method

    BENCH_LISTED_ROOMS = int(os.environ.get("BENCH_LISTED_ROOMS", "0"))
    BENCH_LISTED_LOTS = int(os.environ.get("BENCH_LISTED_LOTS", "0"))
    event_channel("bench:room:<int:id>", public=True)
    for _i in range(BENCH_LISTED_ROOMS):
        event_channel(f"bench:listed-room-{_i}")
    app_state("bench:lot:<int:id>", default=1000, min=100, max=10000, public=True)
    for _i in range(BENCH_LISTED_LOTS):
        app_state(f"bench:listed-lot-{_i}", default=1000, min=100, max=10000)

    @rpc_method("bench.bids", cost=0)
    async def bench_bids(consumer: object, params: dict) -> dict:
        """``rate`` bids a second on each of ``lots`` lots for ``seconds`` (each a new
        price on ``bench:lot:<i>``, or ``bench:listed-lot-<i>`` with ``listed``), on a
        drift-free schedule of 10 rounds a second; returns what it published."""
        lots, rate, seconds = int(params["lots"]), float(params["rate"]), float(params["seconds"])
        name = "bench:listed-lot-{}" if params.get("listed") else "bench:lot:{}"
        loop = _asyncio.get_running_loop()
        started = deadline = loop.time()
        published, price, owed = 0, 0, 0.0
        while loop.time() - started < seconds:
            owed += rate / 10
            price += 1
            while owed >= 1:
                owed -= 1
                for lot in range(lots):
                    await apublish(name.format(lot), {"lot": lot, "price": price})
                    published += 1
            deadline += 0.1
            await _asyncio.sleep(max(0.0, deadline - loop.time()))
        return {"published": published, "seconds": round(loop.time() - started, 3)}


if "bench:presence" not in registry.exact:  # bench/presence.py: presence vs a message per join/leave
    from urllib.parse import parse_qs

    from realtime_app import event_channel as _event_channel
    from realtime_app.endpoint.consumer import RealtimeConsumer

    _event_channel("bench:presence", presence=True)
    PRESENCE_GROUP = "bench-presence"

    class BenchUser:
        """A member of bench/presence.py: signed in as ``?user=<name>``, no database row."""

        is_authenticated = True
        is_anonymous = False
        is_active = True

        def __init__(self, name: str) -> None:
            self.username = self.pk = name

        def get_username(self) -> str:
            return self.username

    def _named(app: Any) -> Any:
        async def named(scope: dict, receive: Any, send: Any) -> None:
            name = parse_qs(scope.get("query_string", b"").decode()).get("user", [""])[0]
            await app({**scope, "user": BenchUser(name)} if name else scope, receive, send)

        return named

    class PresenceGroupConsumer(AsyncWebsocketConsumer):
        """Presence the plain Channels way: watchers are in a group, and each join or leave
        of a member (a ``join`` / ``leave`` text) is one group_send to all of them."""

        async def connect(self) -> None:
            self.user = parse_qs(self.scope.get("query_string", b"").decode()).get("user", [""])[0]
            if not self.user:  # a watcher
                await self.channel_layer.group_add(PRESENCE_GROUP, self.channel_name)
            await self.accept()

        async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
            change = {"join": "joined", "leave": "left"}[text_data or ""]
            text = json.dumps({"channel": "bench:presence", change: [self.user]})
            await self.channel_layer.group_send(PRESENCE_GROUP, {"type": "bench.frame", "text": text})

        async def disconnect(self, code: int) -> None:
            if not self.user:
                await self.channel_layer.group_discard(PRESENCE_GROUP, self.channel_name)

        async def bench_frame(self, event: dict) -> None:
            await self.send(text_data=event["text"])

    PRESENCE_ROUTES = [
        path("presence-bench/", _named(RealtimeConsumer.as_asgi())),
        path("presence-baseline/", PresenceGroupConsumer.as_asgi()),
    ]

application = ProtocolTypeRouter(
    {
        "http": MetricsShortcut(django_asgi_app),  # as the demo: bench/connections.py's reads carry the token
        # users from the session, as in the demo (bench/admission.py's signed-in user); both
        # endpoints behind it, so that a comparison of the two pays it on both sides
        "websocket": AuthMiddlewareStack(
            URLRouter([*websocket_urlpatterns, *PRESENCE_ROUTES, path("baseline/", BaselineConsumer.as_asgi())])
        ),
    }
)

if os.environ.get("BENCH_TRACEMALLOC"):  # bench/connections.py: where a connection's bytes go
    import signal
    import tracemalloc

    tracemalloc.start(1)

    def _dump(signum: int, frame: object) -> None:
        tracemalloc.take_snapshot().dump(os.environ["BENCH_TRACEMALLOC"] + f".{os.getpid()}.{time.monotonic_ns()}")

    import time

    signal.signal(signal.SIGUSR1, _dump)
