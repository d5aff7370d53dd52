"""An SSE stream's positions (``realtime_app.outbound.sse.EventStream``), the pure core, under
every interleaving hypothesis finds of what the hub does to it: publications of two
channels with history written or dropped by the guard, frames written twice (a replay
overlapping live ones), histories replaced (a new epoch), resumes settling.

What a client reading the stream must be able to rely on: on each channel, publications
in ``seq`` order, never one twice, never a hole it is not told about (a ``realtime.resync``
before it, or the stream's end with ``realtime.close``); nothing after the close; and the
``id`` of every event is where the client is — resuming from it misses nothing."""

from __future__ import annotations

import json

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from realtime_app.outbound.sse import EventStream, parse_positions
from realtime_app.wire.event_stream import EventParser
from realtime_app.wire.history import new_epoch
from realtime_app.wire.protocol import notification_text

CHANNELS = ("a:one", "b:two")


class ListSink:
    kind = "memory"
    measurable = False

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def buffered(self) -> int:
        return 0

    def write(self, data: bytes, chunk: bytes | None = None) -> bool:
        self.written.append(data)
        return True

    def abort(self) -> None:
        pass

    def pause_reading(self, seconds: float) -> None:
        pass


class StreamMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sink = ListSink()
        self.stream = EventStream(self.sink)
        self.stream.open(1000)
        self.epoch = {c: new_epoch(1_000_000) for c in CHANNELS}
        self.top = dict.fromkeys(CHANNELS, 0)
        self.sent: dict[str, list[bytes]] = {c: [] for c in CHANNELS}  # every publication, in seq order
        self.epochs_made = 1
        self.parser = EventParser()

    def _payload(self, channel: str, seq: int) -> bytes:
        return notification_text(channel, json.dumps({"n": seq}), seq, 1, self.epoch[channel]).encode()

    @rule(channel=st.sampled_from(CHANNELS), drop=st.booleans())
    def publish(self, channel: str, drop: bool) -> None:
        self.top[channel] += 1
        payload = self._payload(channel, self.top[channel])
        self.sent[channel].append(payload)
        if drop:
            self.stream.dropped(payload)  # the guard refused it
        else:
            self.stream.write(payload)

    @precondition(lambda self: any(self.sent.values()))
    @rule(channel=st.sampled_from(CHANNELS), back=st.integers(0, 5))
    def written_again(self, channel: str, back: int) -> None:
        """A replayed frame the stream had already (a replay overlapping live frames)."""
        if self.sent[channel]:
            self.stream.write(self.sent[channel][max(0, len(self.sent[channel]) - 1 - back)])

    @rule(channel=st.sampled_from(CHANNELS))
    def history_replaced(self, channel: str) -> None:
        self.epochs_made += 1
        self.epoch[channel] = new_epoch(1_000_000 + self.epochs_made)
        self.top[channel] = 0
        self.sent[channel] = []

    @rule(channel=st.sampled_from(CHANNELS), skipped=st.integers(1, 3))
    def resume_that_history_cannot_fill(self, channel: str, skipped: int) -> None:
        """A channel resubscribed while the stream was away: its first frame jumps."""
        self.stream.settling(channel)
        self.top[channel] += skipped
        payload = self._payload(channel, self.top[channel])
        self.sent[channel].append(payload)
        self.stream.write(payload)
        for held in self.stream.settled(channel, {"epoch": self.epoch[channel], "seq": self.top[channel]}):
            self.stream.write(held)  # what the consumer sends through the guard

    @invariant()
    def a_reader_is_never_misled(self) -> None:
        events = []
        for data in self.sink.written:
            events += self.parser.feed(data.decode())
        self.sink.written.clear()
        self._check(events)

    def _check(self, events: list) -> None:
        state = getattr(self, "_seen", None)
        if state is None:
            state = self._seen = {"at": {}, "closed": False, "told": set()}
        for event in events:
            assert not state["closed"], "an event after the close"
            if event.event == "realtime.close":
                state["closed"] = True
                continue
            data = json.loads(event.data)
            if event.event == "realtime.resync":
                state["told"].add(data["channel"])
                state["at"][data["channel"]] = (data["epoch"], data["seq"])
                continue
            channel, seq, epoch = data["channel"], data["seq"], data["epoch"]
            at = state["at"].get(channel)
            if at is not None and at[0] == epoch:
                assert seq == at[1] + 1, f"{channel}: {seq} after {at[1]} without a word"
            elif at is not None:
                assert channel in state["told"], f"{channel}: a new epoch without a resync"
            state["told"].discard(channel)
            state["at"][channel] = (epoch, seq)
            resumed = parse_positions(event.id)
            assert resumed.get(channel) == (epoch, seq), "the id is not where the client is"


StreamMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestStreamPositions = StreamMachine.TestCase


def _events(sink: ListSink) -> list:
    parser = EventParser()
    return [e for data in sink.written for e in parser.feed(data.decode())]


def test_a_client_that_says_it_is_further_than_the_history_is_resynced_and_loses_nothing_live():
    """Found: a Last-Event-ID ahead of the history (a crafted one, a failover that lost
    writes) had every later frame swallowed as "had it already", and no resync said."""
    epoch = new_epoch(1_000_000)
    for claimed in ((epoch, 10), (new_epoch(9_000_000), 10)):  # further on the epoch, or on a newer one
        sink = ListSink()
        stream = EventStream(sink, {"a:one": claimed})
        stream.open(1000)
        stream.settling("a:one")
        for seq in (6, 7):  # live frames while its resume is answered (the history's top is 5)
            stream.write(notification_text("a:one", "{}", seq, 1, epoch).encode())
        held = stream.settled("a:one", {"epoch": epoch, "seq": 5, "recovered": False, "reason": "ahead"})
        stream.send_event("realtime.subscribed", {"channel": "a:one", "epoch": epoch, "seq": 5})
        for payload in held:  # what the consumer sends through the guard
            stream.write(payload)
        stream.write(notification_text("a:one", "{}", 8, 1, epoch).encode())
        events = _events(sink)
        assert [e.event for e in events] == ["realtime.resync", "realtime.subscribed", "a:one", "a:one", "a:one"]
        assert json.loads(events[0].data)["seq"] == 5
        assert [json.loads(e.data)["seq"] for e in events[2:]] == [6, 7, 8]
        assert parse_positions(events[-1].id) == {"a:one": (epoch, 8)}


def test_a_stream_id_names_only_its_own_channels():
    """Found: every position a client ever sent came back in the id, which only grew."""
    stream = EventStream(ListSink(), {"a:one": ("e", 1), "gone:channel": ("e", 9)})
    stream.keep_only({"a:one"})
    stream.open(1000)
    stream.send_event("realtime.subscribed", {})
    assert parse_positions(EventParser().feed(stream.sink.written[-1].decode())[0].id) == {"a:one": ("e", 1)}
