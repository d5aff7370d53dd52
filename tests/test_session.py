"""The JSON-RPC session without sockets (realtime_app.wire.session): the server's frame
checks and error books, the client's ids, subscribe book, cursors and delta bases — and a
hypothesis machine that drives the client's end through calls, answers, messages,
unsubscribes and closes in any order."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from realtime_app.wire.protocol import CloseCode
from realtime_app.wire.session import Answer, ClientSession, Close, Deliver, Notify, Recover, Resubscribe, ServerSession


def test_the_server_session_refuses_binary_and_oversized_frames_then_ignores_what_follows():
    session: ServerSession[str] = ServerSession(max_frame_bytes=100, max_batch=2)
    assert session.receive(None) == Close(CloseCode.UNSUPPORTED_DATA, "binary frames are not supported")
    assert session.receive('{"jsonrpc": "2.0", "method": "ping", "id": 1}') is None  # closing: nothing runs
    session = ServerSession(max_frame_bytes=100, max_batch=2)
    assert session.receive("é" * 60) == Close(CloseCode.MESSAGE_TOO_BIG, "frame over 100 bytes")  # 120 bytes
    session = ServerSession(max_frame_bytes=1000, max_batch=2)
    frame = session.receive('[{"jsonrpc": "2.0", "method": "ping", "id": 1}, {"jsonrpc": "2.0", "method": "x"}]')
    assert frame is not None and not isinstance(frame, Close)
    assert frame.is_batch and [r.method for r in frame.requests] == ["ping", "x"]
    frame = session.receive(json.dumps([{"jsonrpc": "2.0", "method": "ping", "id": i} for i in range(3)]))
    assert frame is not None and not isinstance(frame, Close) and frame.errors and not frame.requests  # over MAX_BATCH


def test_the_server_session_counts_bad_input_and_hands_over_what_follows_an_answer():
    session: ServerSession[str] = ServerSession(max_frame_bytes=0, max_batch=50)
    assert session.count_error("invalid_params") is True  # the first is logged
    assert session.count_error("invalid_params") is False
    assert session.count_error("unknown_method") is True
    assert session.error_summary() == {"invalid_params": 2}
    session.follow_answer("lot:1")
    session.follow_answer("lot:2")
    assert session.answered() == ["lot:1", "lot:2"] and session.answered() == []


def _message(channel: str, seq: int, epoch: str = "e1", data: object = None) -> str:
    params = {"channel": channel, "data": data, "seq": seq, "epoch": epoch, "ts": 0}
    return json.dumps({"jsonrpc": "2.0", "method": "message", "params": params})


def test_the_client_session_orders_a_history_channel_around_its_subscribe_answer():
    session = ClientSession()
    assert session.book("lot:0042", print) == "first" and session.book("lot:0042", repr) == ""
    params, canonical, cursor = session.subscribe_request("lot:0042")
    assert params == {"channel": "lot:0042"} and canonical == "lot:0042"
    request_id, text = session.request("subscribe", params, (canonical, cursor))
    assert json.loads(text) == {"jsonrpc": "2.0", "method": "subscribe", "params": params, "id": request_id}
    assert session.receive(_message("lot:0042", 6)) == []  # held until the answer gives the position
    answer = {"channel": "lot:0042", "kind": "event", "interval_ms": 0, "epoch": "e1", "seq": 5}
    events = session.receive(json.dumps({"jsonrpc": "2.0", "result": answer, "id": request_id}))
    assert [type(e) for e in events] == [Deliver, Answer] and events[0].params["seq"] == 6  # type: ignore[union-attr]
    session.subscribed("lot:0042", answer)
    assert session.receive(_message("lot:0042", 6)) == []  # had it
    assert session.receive(_message("lot:0042", 8)) == [Recover("lot:0042")]  # 7 is missing: resume
    recover = session.recover_request("lot:0042")
    assert recover is not None and recover[0] == {"channel": "lot:0042", "since": {"seq": 6, "epoch": "e1"}}
    assert session.closed() == [] and session.cursors["lot:0042"].recovering is False
    assert session.unbook("lot:0042", print) is None  # another handler stays
    assert session.unbook("lot:0042") == "lot:0042" and session.cursors == {} and session.handlers == {}


def test_the_client_session_resubscribes_once_when_a_delta_does_not_apply():
    session = ClientSession()
    session.book("state", print, delta=True)
    params, canonical, cursor = session.subscribe_request("state")
    assert params["delta"] == "fossil"
    frame = {
        "jsonrpc": "2.0",
        "method": "message",
        "params": {"channel": "state", "seq": 1, "delta": True, "data": "x"},
    }
    assert session.receive(json.dumps(frame)) == [Resubscribe("state", ("state",))]  # a delta without its base
    assert session.receive(json.dumps(frame)) == []  # once: the full frame is on its way
    full = {
        "jsonrpc": "2.0",
        "method": "message",
        "params": {"channel": "state", "seq": 2, "delta": False, "data": "1"},
    }
    assert session.receive(json.dumps(full)) == [Deliver("state", {**full["params"], "data": 1})]  # type: ignore[dict-item]


def test_the_client_session_answers_errors_and_drops_what_nobody_waits_for():
    session = ClientSession()
    first, _ = session.request("demo.bid", {"lot": 1})
    second, _ = session.request("demo.bid", {"lot": 2})
    session.forget(second)  # timed out
    error = {"code": -32005, "message": "Rate limited", "data": {"reason": "rate_limited", "retry_after_ms": 10}}
    frame = [{"jsonrpc": "2.0", "error": error, "id": first}, {"jsonrpc": "2.0", "result": 1, "id": second}]
    assert session.receive(json.dumps(frame)) == [Answer(first, False, error)]
    assert session.receive("not json") == [] and session.errors == {"not_json": 1}
    third, _ = session.request("ping")
    assert session.closed() == [third] and session.in_flight == {}


CHANNELS = ("a", "b")


class ClientSessionMachine(RuleBasedStateMachine):
    """Any order of book, subscribe, answers, messages (in order, late, repeated), closes
    and unbooks: no id is answered twice or after it was forgotten, nothing is kept for a
    channel nobody books once its subscribe ended, and a history channel's messages reach
    the application once each, in order, or with a resync."""

    @initialize()
    def start(self) -> None:
        self.session = ClientSession()
        self.subscribes: dict[int, str] = {}  # in flight: id -> channel
        self.top = dict.fromkeys(CHANNELS, 0)  # the server's last seq per channel
        self.delivered: dict[str, list[int]] = {c: [] for c in CHANNELS}
        self.answered: set[int] = set()

    def _feed(self, text: str) -> None:
        for event in self.session.receive(text):
            if isinstance(event, Answer):
                assert event.id not in self.answered
                self.answered.add(event.id)
                self.subscribes.pop(event.id, None)
            elif isinstance(event, Deliver):
                seqs = self.delivered[event.channel]
                assert not seqs or event.params["seq"] > seqs[-1]  # once, in order
                seqs.append(event.params["seq"])
            elif isinstance(event, Notify) and event.kind == "resync":
                self.delivered[event.channel].clear()  # the application reloads its state

    @rule(channel=st.sampled_from(CHANNELS))
    def subscribe(self, channel: str) -> None:
        self.session.book(channel, print)
        params, canonical, cursor = self.session.subscribe_request(channel)
        request_id, _ = self.session.request("subscribe", params, (canonical, cursor))
        self.subscribes[request_id] = channel

    @precondition(lambda self: self.subscribes)
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.subscribes)))
        channel = self.subscribes[request_id]
        result = {"channel": channel, "kind": "event", "interval_ms": 0, "epoch": "e1", "seq": self.top[channel]}
        self._feed(json.dumps({"jsonrpc": "2.0", "result": result, "id": request_id}))
        self.session.subscribed(channel, result)

    @rule(channel=st.sampled_from(CHANNELS), late=st.booleans())
    def publish(self, channel: str, late: bool) -> None:
        if not late:
            self.top[channel] += 1
        self._feed(_message(channel, max(1, self.top[channel] - (1 if late else 0))))

    @rule(channel=st.sampled_from(CHANNELS))
    def unbook(self, channel: str) -> None:
        self.session.unbook(channel)
        self.delivered[channel] = []  # a later subscription is a new stream

    @rule()
    def close(self) -> None:
        lost = set(self.session.closed())
        assert lost.isdisjoint(self.answered)
        self.subscribes.clear()

    @invariant()
    def books_hold_only_what_is_used(self) -> None:
        session = self.session
        assert set(session.in_flight) >= set(session._follows)
        following = {channel for channel, _ in session._follows.values()}
        booked = {session.canonical.get(n, n) for n in session.handlers}
        assert set(session.cursors) <= booked | following


TestClientSession = ClientSessionMachine.TestCase
TestClientSession.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_an_idempotent_call_gets_a_key_of_its_own_unless_given_and_takes_by_name_params():
    first, second = ClientSession.keyed({"lot": 1}), ClientSession.keyed(None)
    assert first["lot"] == 1 and len(first["idempotency_key"]) == 32
    assert first["idempotency_key"] != second["idempotency_key"]
    assert ClientSession.keyed({"idempotency_key": "mine"})["idempotency_key"] == "mine"
    with pytest.raises(ValueError, match="by-name"):
        ClientSession.keyed([1, 2])
