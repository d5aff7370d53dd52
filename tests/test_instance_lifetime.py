"""The pure cores of channels per object, as state machines: live instances are counted
while one of their channels is subscribed and never longer (no leak, none forgotten while
used, the bounds always honoured), and an app-fed cadence sends the newest value at most
once a period, only when it changed, and never loses the last one."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from realtime_app.declarations.instances import InstanceBook
from realtime_app.declarations.registry import fed_channel, registry
from realtime_app.hub.connections import Connection
from realtime_app.hub.fed import MISSING, Pace

TEMPLATES = ["lot:<int:id>", "bids:<int:lot>"]
BASES = {"lot:<int:id>": ["lot:1", "lot:2", "lot:3"], "bids:<int:lot>": ["bids:1", "bids:2"]}
CADENCES = ["", ":250", ":2000"]
PER_TEMPLATE, PER_PROCESS = 2, 3


class Instances(RuleBasedStateMachine):
    """Subscriptions come and go (a channel is a cadence of an instance); the book must
    agree with the subscriptions at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.book = InstanceBook()
        self.subscribed: dict[str, tuple[str, str]] = {}  # channel -> (template, base)

    @rule(template=st.sampled_from(TEMPLATES), data=st.data())
    def subscribe(self, template: str, data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(BASES[template]))
        channel = base + data.draw(st.sampled_from(CADENCES))
        refused = self.book.refusal(template, base, PER_TEMPLATE, PER_PROCESS)
        live_bases = {b for t, b in self.subscribed.values() if t == template}
        if base in live_bases:
            assert refused is None  # a live instance always fits
        elif len(live_bases) >= PER_TEMPLATE:
            assert refused == ("template", PER_TEMPLATE)
        elif len({b for _, b in self.subscribed.values()}) >= PER_PROCESS:
            assert refused == ("process", PER_PROCESS)
        else:
            assert refused is None
        if refused is None:
            self.book.add(template, base, channel)
            self.subscribed[channel] = (template, base)

    @precondition(lambda self: self.subscribed)
    @rule(data=st.data())
    def unsubscribe(self, data: st.DataObject) -> None:
        channel = data.draw(st.sampled_from(sorted(self.subscribed)))
        template, base = self.subscribed.pop(channel)
        self.book.remove(template, base, channel)

    @rule(template=st.sampled_from(TEMPLATES), channel=st.sampled_from(["lot:9", "bids:9:250"]))
    def remove_what_was_never_added(self, template: str, channel: str) -> None:
        self.book.remove(template, channel.split(":250")[0], channel)  # a second unsubscribe: harmless

    @invariant()
    def the_book_is_the_subscriptions(self) -> None:
        expected: dict[str, dict[str, set[str]]] = {}
        for channel, (template, base) in self.subscribed.items():
            expected.setdefault(template, {}).setdefault(base, set()).add(channel)
        assert self.book.live == expected  # nothing leaked, nothing forgotten while used
        assert self.book.total == sum(len(bases) for bases in expected.values()) <= PER_PROCESS
        assert all(self.book.count(t) <= PER_TEMPLATE for t in TEMPLATES)


TestInstances = Instances.TestCase


class Pacing(RuleBasedStateMachine):
    """Values arrive (in any order, repeated), time passes, the timer fires when the pace
    says: what is sent is always the newest value known, at most once a period, only
    when it changed; once time has passed, the newest value has been sent."""

    PERIOD = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.pace = Pace(self.PERIOD)
        self.now = 0.0
        self.newest = (0, None)  # (version, text)
        self.sent: list[tuple[float, str]] = []
        self.timer: float | None = None

    @rule(version=st.integers(1, 30), value=st.sampled_from(["a", "b", "c"]))
    def a_value_arrives(self, version: int, value: str) -> None:
        at = self.pace.offer(version, value, value, self.now)
        if version > self.newest[0]:
            self.newest = (version, value)
        if at is not None:
            assert at >= self.now
            self.timer = at if self.timer is None else min(self.timer, at)

    @rule(dt=st.floats(0.0, 2.5))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        while self.timer is not None and self.timer <= self.now:
            fired_at, self.timer = self.timer, None
            value = self.pace.due(fired_at)
            if value is not MISSING:
                self.sent.append((fired_at, value))
            elif self.pace.text is not None and self.pace.text != self.pace.sent:
                self.timer = self.pace.last_at + self.PERIOD  # as FedStates does after an early wake

    @invariant()
    def at_most_once_a_period_only_changes_newest_last(self) -> None:
        times = [t for t, _ in self.sent]
        assert all(b - a >= self.PERIOD - 1e-9 for a, b in zip(times, times[1:], strict=False))
        values = [v for _, v in self.sent]
        assert all(a != b for a, b in zip(values, values[1:], strict=False))  # only on change
        if self.newest[1] is not None and self.timer is None:
            assert values and values[-1] == self.newest[1]  # nothing pending: the newest was sent


TestPacing = Pacing.TestCase


class HubInstances(RuleBasedStateMachine):
    """The real hub (in-memory backplane, its own loop): connections subscribe to
    instances and cadences, leave, publish, disconnect. At every step the hub's instances
    are exactly those its subscriptions name; app-fed pacing and tickers run only for
    subscribed channels; once every connection is gone nothing is left."""

    NAMES = ["test:lot:1:250", "test:lot:1:500", "test:lot:2", "test:bids:1", "test:bids:2", "test:room:a:load:50"]

    def __init__(self) -> None:
        super().__init__()
        from django.test import override_settings

        from realtime_app.conf import get_config
        from realtime_app.hub.core import Hub

        self.settings = override_settings(REALTIME_APP={**get_config(), "MAX_BACKPRESSURE": 0})  # no transport
        self.settings.enable()
        self.loop = asyncio.new_event_loop()
        self.hub = Hub()
        self.run(self.hub.start())
        self.conns = [self.connection() for _ in range(3)]

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def connection(self) -> Connection:
        async def send(message: dict[str, Any]) -> None:
            pass

        conn = Connection(send)
        self.hub.add_connection(conn)
        return conn

    @rule(i=st.integers(0, 2), name=st.sampled_from(NAMES))
    def subscribe(self, i: int, name: str) -> None:
        spec = registry.resolve(name)
        if spec.history is not None:
            self.run(self.hub.subscribe_kept(self.conns[i], spec))
        else:
            self.run(self.hub.subscribe(self.conns[i], spec))

    @rule(i=st.integers(0, 2), name=st.sampled_from(NAMES))
    def unsubscribe(self, i: int, name: str) -> None:
        self.run(self.hub.unsubscribe(self.conns[i], registry.resolve(name).name))

    @rule(lot=st.integers(1, 3), price=st.integers(0, 3))
    def publish(self, lot: int, price: int) -> None:
        spec = registry.resolve(f"test:lot:{lot}")
        self.run(self.hub.publish(fed_channel(spec.base), {"price": price}, spec.fed))
        self.run(self.hub.publish(f"test:bids:{lot}", {"price": price}))

    @rule(i=st.integers(0, 2))
    def disconnect(self, i: int) -> None:
        self.run(self.hub.remove_connection(self.conns[i]))
        self.conns[i] = self.connection()

    @rule()
    def let_the_loop_run(self) -> None:
        self.run(asyncio.sleep(0.01))

    @invariant()
    def instances_are_the_subscriptions(self) -> None:
        hub = self.hub
        assert set(hub.specs) == set(hub.subscribers)
        expected: dict[str, dict[str, set[str]]] = {}
        for channel, spec in hub.specs.items():
            if spec.declared is not None:
                expected.setdefault(spec.declared.pattern, {}).setdefault(spec.base, set()).add(channel)
        assert hub.instances.live == expected  # none leaked, none forgotten while used
        paced = {channel for channels in hub.fed.paces.values() for channel in channels}
        assert paced <= set(hub.subscribers)  # pacing only what is subscribed here
        assert set(hub.tickers.book.tickers) <= set(hub.subscribers)

    def teardown(self) -> None:
        try:
            for conn in self.conns:
                self.run(self.hub.remove_connection(conn))
            self.run(asyncio.sleep(0.05))
            hub = self.hub
            assert hub.instances.live == {} and hub.instances.total == 0
            assert hub.specs == {} and hub.fed.paces == {} and hub.fed.timers == {}
            assert hub.tickers.book.tickers == {} and hub.current.frames == {}
        finally:
            self.run(self.hub.aclose())
            left = asyncio.all_tasks(self.loop)  # the write-behind stores the hub started
            for task in left:
                task.cancel()
            self.run(asyncio.gather(*left, return_exceptions=True))
            self.loop.close()
            self.settings.disable()


TestHubInstances = HubInstances.TestCase
TestHubInstances.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


def test_a_new_epoch_restarts_the_versions_of_an_app_fed_value():
    """Redis lost the kept value (a restart, a flush): versions count from 1 again under a
    new epoch, and the cadence takes them instead of waiting for the old numbers."""
    pace = Pace(1.0)
    assert pace.offer(500, "a", "a", 0.0, "e1") == 0.0
    assert pace.due(0.0) == "a"
    assert pace.offer(3, "b", "b", 5.0, "e1") is None  # an old value of the same epoch: ignored
    assert pace.offer(1, "b", "b", 5.0, "e2") == 5.0  # a new epoch: taken
    assert pace.due(5.0) == "b"
