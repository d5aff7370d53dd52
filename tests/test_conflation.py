"""Conflation as a pure machine (realtime_app.outbound.conflation and the guard's
conflated path) over a model of a connection's queue that the client drains when it
reads: whatever the order of publications, reads and drains, the queue never grows past
the threshold plus one frame, at most one frame per channel is held, a channel's values
arrive in order, and once the client has read everything and the held frames are
offered, it holds every channel's latest value."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from realtime_app.outbound.backpressure import HOLD, SEND, BackpressureConfig
from realtime_app.outbound.conflation import Held
from realtime_app.outbound.guard import Guard
from tests.support.queue_model import QueueModel, frame

CHANNELS = ["a", "b", "c"]


class Conflating(RuleBasedStateMachine):
    @initialize(
        threshold=st.integers(1, 400),  # 0 switches the guard off
        policy=st.sampled_from(["drop", "close"]),  # the process's rule for other channels
        close_after=st.integers(0, 3),  # closing on: a conflated channel must never close (found: always off here)
    )
    def setup(self, threshold: int, policy: str, close_after: int) -> None:
        self.transport = QueueModel()
        self.guard = Guard(lambda message: None, BackpressureConfig(threshold, policy, close_after), self.transport)
        self.threshold = threshold
        self.published = dict.fromkeys(CHANNELS, -1)
        self.received: dict[str, list[int]] = {c: [] for c in CHANNELS}
        self.biggest = 0

    @rule(channel=st.sampled_from(CHANNELS), size=st.integers(0, 200))
    def publish(self, channel: str, size: int) -> None:
        value = self.published[channel] + 1
        self.published[channel] = value
        payload = frame(channel, value, size)
        self.biggest = max(self.biggest, len(payload))
        assert self.guard.send_conflated(channel, payload) in (SEND, HOLD)

    @rule(count=st.integers(1, 5))
    def client_reads(self, count: int) -> None:
        for _ in range(min(count, len(self.transport.queue))):
            channel, value, _ = self.transport.queue.popleft().split(b":", 2)
            self.received[channel.decode()].append(int(value))

    @rule()
    def drain(self) -> None:
        self.guard.flush_held()

    @invariant()
    def bounded_and_in_order(self) -> None:
        if not hasattr(self, "guard"):
            return
        assert self.transport.buffered() <= self.threshold + self.biggest
        held = self.guard.held or Held()
        assert len(held) <= len(CHANNELS) and len(set(held.frames)) == len(held)
        for values in self.received.values():
            assert values == sorted(values) and len(values) == len(set(values))

    def teardown(self) -> None:
        if not hasattr(self, "guard"):
            return
        for _ in range(1000):  # the client reads on; the drain offers the rest
            if not (self.transport.queue or self.guard.held):
                break
            self.client_reads(5)
            self.drain()
        assert not (self.transport.queue or self.guard.held), "held frames never written"
        for channel, value in self.published.items():
            assert value < 0 or self.received[channel][-1] == value, (channel, self.received[channel], value)


TestConflating = Conflating.TestCase
TestConflating.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_a_newer_frame_replaces_the_held_one_and_moves_to_the_end():
    held = Held()
    assert held.put("a", b"a1", None) is False
    held.put("b", b"b1", None)
    assert held.put("a", b"a2", None) is True
    assert held.conflated == 1 and len(held) == 2
    assert [held.take()[:2], held.take()[:2]] == [("b", b"b1"), ("a", b"a2")]


def test_held_frames_go_before_any_other_frame():
    """A frame of another channel sent while one is held goes after it: the held frame is
    older, and values arrive in the order they were published (the flush before a send
    removed: the plain frame comes first)."""
    transport = QueueModel()
    guard = Guard(lambda message: None, BackpressureConfig(100, "drop", 5), transport)
    assert guard.send_conflated("a", frame("a", 0, 150)) is SEND  # the queue is over the threshold now
    assert guard.send_conflated("a", frame("a", 1, 10)) is HOLD
    transport.queue.clear()  # the client read everything; no drain has run yet
    assert guard.send(frame("p", 0, 10)) is SEND
    assert [payload.split(b":")[:2] for payload in transport.queue] == [[b"a", b"1"], [b"p", b"0"]]
