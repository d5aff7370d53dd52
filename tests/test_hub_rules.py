"""The hub's rules, pure: the order of frames with history, what a ticker owns, when the
beat re-asserts and declares an outage, lease freshness, a replay's positions and pace.
No Redis, no event loop: each takes ``now`` and returns what to do."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from realtime_app.hub.beat import SLOW_BEATS_DOWN, BeatRule
from realtime_app.hub.ordering import Sequencer
from realtime_app.hub.reconciler import Action, Reconciler
from realtime_app.hub.replay import MAX_REPLAY_BUFFER, pace
from realtime_app.hub.tickers import MISSING, TickerBook
from realtime_app.wire.history import already_sent, new_epoch

WINDOW = 0.05


class SequencerMachine(RuleBasedStateMachine):
    """Frames of one epoch arrive in any order, some twice, some never; time passes.

    Every frame that arrives goes out at least once (at once, or when the window passes);
    the frames that go out on time do so in ``seq`` order; nothing stays held once the
    window has passed; the gaps counted are the ``seq`` skipped over."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = Sequencer(WINDOW)
        self.now = 0.0
        self.epoch = new_epoch()
        self.arrived: set[int] = set()
        self.sent: list[int] = []
        self.in_order: list[int] = []  # what went out not late
        self.gaps = 0

    @initialize(top=st.integers(0, 5))
    def read(self, top: int) -> None:
        self.seq.read("c", self.epoch, top)
        self.top = top

    @rule(offset=st.integers(1, 12))
    def frame(self, offset: int) -> None:
        seq = self.top + offset
        order = self.seq.orders["c"]
        late = seq < order.next
        out = self.seq.frame("c", f"t{seq}", seq, self.epoch, self.now)
        self.arrived.add(seq)
        for text, s, epoch in out:
            assert text == f"t{s}" and epoch == self.epoch
            self.sent.append(s)
            if not late:
                self.in_order.append(s)

    @rule(dt=st.floats(0, 0.1))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        due = self.seq.due("c")
        out, gaps = self.seq.expire("c", self.now)
        assert bool(out) == (due is not None and self.now >= due)
        self.gaps += gaps
        for _, s, _ in out:
            self.sent.append(s)
            self.in_order.append(s)

    @invariant()
    def in_seq_order_and_nothing_lost(self) -> None:
        assert self.in_order == sorted(set(self.in_order))  # increasing, none twice
        order = self.seq.orders["c"]
        assert all(s >= order.next for s in order.held)
        assert set(self.sent) | set(order.held) == self.arrived  # out, or held for the window
        assert (order.due is None) == (not order.held)
        if order.due is not None:
            assert order.due <= self.now + WINDOW

    def teardown(self) -> None:
        out, gaps = self.seq.expire("c", math.inf)
        self.gaps += gaps
        self.sent += [s for _, s, _ in out]
        assert set(self.sent) == self.arrived  # every frame that came went out
        highest = max(self.in_order + [s for _, s, _ in out], default=self.top)
        assert self.gaps == len(set(range(self.top + 1, highest + 1)) - set(self.in_order) - {s for _, s, _ in out})


TestSequencer = SequencerMachine.TestCase
TestSequencer.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_newer_epoch_starts_the_order_anew_and_a_replaced_one_is_dropped() -> None:
    seq = Sequencer(WINDOW)
    old = new_epoch(1_000)
    seq.read("c", old, 10)
    assert seq.frame("c", "x", 12, old, 0.0) == []  # held: 11 is missing
    newer = new_epoch(2_000)
    assert seq.frame("c", "n", 1, newer, 0.01) == [("n", 1, newer)]
    assert seq.due("c") is None  # what the old epoch held is gone with it
    assert seq.frame("c", "late", 13, old, 0.02) == []  # a frame of the replaced history


class TickerBookMachine(RuleBasedStateMachine):
    """A ticker's factory is called, succeeds, fails or is cancelled; values are offered
    and taken; the ticker stops. Each cleanup comes back exactly once, a value is kept
    only while the ticker lives, and nothing is owned after the last stop."""

    def __init__(self) -> None:
        super().__init__()
        self.book = TickerBook()
        self.live: dict[str, object] = {}  # channel -> its cleanup, for started ones
        self.cleanups_returned: list[object] = []

    channels = st.sampled_from(["a", "b", "c"])

    @rule(channel=channels)
    @precondition(lambda self: True)
    def factory_called(self, channel: str) -> None:
        if channel in self.book.tickers:
            return  # the reconciler starts a running ticker at most once
        self.book.starting(channel)

    @rule(channel=channels)
    def factory_returned(self, channel: str) -> None:
        ticker = self.book.tickers.get(channel)
        if ticker is None or ticker.started:
            return
        cleanup = object()
        self.book.started(channel, cleanup)  # type: ignore[arg-type]
        self.live[channel] = cleanup

    @rule(channel=channels)
    def factory_failed_or_cancelled(self, channel: str) -> None:
        ticker = self.book.tickers.get(channel)
        if ticker is None or ticker.started:
            return
        assert self.book.stop(channel) is None  # nothing to clean up yet
        self.book.fail(channel)

    @rule(channel=channels, value=st.integers())
    def offered(self, channel: str, value: int) -> None:
        kept = self.book.offer(channel, value)
        assert kept == (channel in self.book.tickers)
        if kept:
            assert self.book.has_pending(channel)

    @rule(channel=channels)
    def taken(self, channel: str) -> None:
        pending = self.book.has_pending(channel)
        data = self.book.take(channel)
        assert (data is not MISSING) == pending
        assert not self.book.has_pending(channel)

    @rule(channel=channels)
    def stopped(self, channel: str) -> None:
        cleanup = self.book.stop(channel)
        if cleanup is not None:
            self.cleanups_returned.append(cleanup)
            assert self.live.pop(channel) is cleanup
        assert channel not in self.book.tickers and channel not in self.book.failing

    @invariant()
    def owned_only_while_it_lives(self) -> None:
        assert set(self.book.pending()) <= set(self.book.tickers)
        assert set(self.live) == {c for c, t in self.book.tickers.items() if t.started}
        assert len(self.cleanups_returned) == len(set(map(id, self.cleanups_returned)))  # each once

    def teardown(self) -> None:
        for channel in list(self.book.tickers):
            self.stopped(channel)
        assert not self.book.tickers and not self.live and not self.book.pending()


TestTickerBook = TickerBookMachine.TestCase
TestTickerBook.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class BeatMachine(RuleBasedStateMachine):
    """Beats reach the backplane or not; remote calls answer. After anything that may
    have lost the backplane's state, the next beat that reaches it re-asserts, once; an
    outage is declared by an error, or by ``SLOW_BEATS_DOWN`` slow beats in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.rule = BeatRule()
        self.owed = True  # a process starts by asserting everything
        self.slow_in_a_row = 0

    @rule()
    def error(self) -> None:
        assert self.rule.unreachable(timed_out=False)
        self.owed, self.slow_in_a_row = True, SLOW_BEATS_DOWN  # down: a slow beat next keeps it down

    @rule()
    def slow(self) -> None:
        self.slow_in_a_row += 1
        assert self.rule.unreachable(timed_out=True) == (self.slow_in_a_row >= SLOW_BEATS_DOWN)
        self.owed = True

    @rule(recovered=st.booleans())
    def remote_call_answered(self, recovered: bool) -> None:
        self.rule.answered(recovered=recovered)
        self.owed = self.owed or recovered

    @rule(recovered=st.booleans(), intact=st.booleans())
    def beat_reached(self, recovered: bool, intact: bool) -> None:
        assert self.rule.reached(recovered=recovered, intact=intact) == (self.owed or recovered or not intact)
        self.owed, self.slow_in_a_row = False, 0


TestBeatRule = BeatMachine.TestCase
TestBeatRule.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_a_lease_is_fresh_for_one_ttl_after_it_was_granted_or_renewed() -> None:
    r = Reconciler()
    r.subscribed("c", ticker=True)
    assert r.next_action("c") is Action.JOIN
    r.done("c", Action.JOIN, True)
    assert not r.lease_fresh("c", 100.0, 3.0)  # never granted
    r.done("c", Action.ACQUIRE, True, now=100.0)
    assert r.lease_fresh("c", 102.9, 3.0) and not r.lease_fresh("c", 103.0, 3.0)
    r.done("c", Action.RENEW, True, now=102.0)
    assert r.lease_fresh("c", 104.9, 3.0)
    r.failed("c", Action.RENEW)  # unreachable: believed held, but the clock runs on
    assert r.lease_fresh("c", 104.9, 3.0) and not r.lease_fresh("c", 105.0, 3.0)
    r.done("c", Action.RENEW, False, now=105.0)  # lost
    assert not r.lease_fresh("c", 105.0, 3.0)


@given(seq=st.integers(0, 100), at_seq=st.integers(0, 100))
def test_a_connection_gets_each_frame_of_its_epoch_once(seq: int, at_seq: int) -> None:
    epoch = new_epoch()
    assert already_sent((epoch, at_seq), epoch, seq) == (seq <= at_seq)
    assert not already_sent(None, epoch, seq)


def test_a_frame_of_a_newer_history_is_sent_one_of_an_older_is_not() -> None:
    older, newer = new_epoch(1_000), new_epoch(2_000)
    assert not already_sent((older, 50), newer, 1)
    assert already_sent((newer, 1), older, 99)


def test_a_replay_sends_when_the_queue_is_calm_waits_then_gives_up() -> None:
    assert pace(queued=10, calm=10, held=0, now=5.0, deadline=1.0) == "send"  # calm wins
    assert pace(queued=11, calm=10, held=0, now=0.5, deadline=1.0) == "wait"
    assert pace(queued=11, calm=10, held=0, now=1.5, deadline=1.0) == "too_slow"
    assert pace(queued=11, calm=10, held=MAX_REPLAY_BUFFER + 1, now=0.5, deadline=1.0) == "too_slow"
