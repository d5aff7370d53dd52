"""The rules of presence, pure (:mod:`realtime_app.wire.presence`): a process's book, the
cluster's merge, the diffs a subscriber applies and the merge of held diffs. A hypothesis
machine drives processes through joins, leaves, second tabs, crashes, restarts and
interval flushes, with a watcher that is sometimes too slow to be written to: whatever
happens, the diffs it applies rebuild the true member set."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from realtime_app.wire.presence import (
    Diff,
    LocalRoom,
    Snapshot,
    apply,
    compose,
    diff,
    members_of,
    merge,
    page,
    parse_part,
    to_params,
    view,
)

USERS = ["ann", "bob", "cat", "dan"]


def test_a_room_counts_a_user_once_and_a_connection_in_two_cadences_once():
    room = LocalRoom()
    assert room.enter(1, "ann") and room.enter(2, "ann") and room.enter(3, None)
    assert not room.enter(1, "ann")  # the same connection in a second cadence
    assert room.users == {"ann": 2} and room.anonymous == 1
    assert not room.exit(1)  # one cadence left: still in
    assert room.exit(1) and room.users == {"ann": 1}
    assert room.exit(2) and room.users == {} and room.exit(3) and not room
    assert not room.exit(99)


def test_parts_merge_across_processes_and_bound_what_one_lists():
    a, b = LocalRoom(), LocalRoom()
    a.enter(1, "ann", {"name": "Ann"})
    a.enter(2, "bob")
    b.enter(3, "ann")
    b.enter(4, None)
    merged = merge([a.part(0), b.part(0)])
    assert merged.users == {"ann": (2, {"name": "Ann"}), "bob": (1, None)}
    assert (merged.anonymous, merged.count) == (1, 3)
    bounded = parse_part(a.part(1))
    assert bounded == ({"ann": (1, {"name": "Ann"})}, 0, 1)  # bob counted, not listed
    assert merge([a.part(1)]).count == 2
    assert merge(["not json", json.dumps({"u": {"x": "bad"}})]).count == 0  # malformed: nothing


def test_a_diff_coalesces_and_is_none_when_nothing_changed():
    before = Snapshot({"ann": (1, None), "bob": (2, None)})
    after = Snapshot({"ann": (2, None), "cat": (1, None)})
    change = diff(before, after, True, 0)
    assert change is not None
    params = to_params("room", change)
    assert params["joined"] == [{"user": "cat", "connections": 1}]
    assert params["left"] == ["bob"]
    assert params["updated"] == [{"user": "ann", "connections": 2}]
    assert diff(after, after, True, 0) is None
    assert apply({"ann": {"user": "ann"}, "bob": {"user": "bob"}}, params).keys() == {"ann", "cat"}


def test_above_the_bound_the_count_only_then_a_reset_when_small_again():
    big = Snapshot({u: (1, None) for u in USERS})
    small = Snapshot({"ann": (1, None)})
    over = diff(small, big, True, 2)
    assert over is not None and not over.listed and over.count == 4
    assert to_params("room", over)["listed"] is False
    assert diff(big, Snapshot({u: (1, None) for u in USERS[:3]} | {"eve": (1, None)}), False, 2) is None
    back = diff(big, small, False, 2)
    assert back is not None and back.reset == {"ann": (1, None)}
    assert members_of(to_params("room", back)) == {"ann": {"user": "ann", "connections": 1}}
    assert view(big, 2) == {"count": 4, "anonymous": 0, "listed": False, "members": []}


def test_a_page_is_bounded_in_bytes_and_lists_anonymous_last_when_asked():
    snapshot = Snapshot({f"user{n:03d}": (1, None) for n in range(100)}, anonymous=3)
    first, more = page(snapshot, None, 500)
    assert more and 1 <= len(first) < 100 and len(json.dumps(first)) <= 500
    rest, more = page(snapshot, first[-1]["user"], 10**6, list_anonymous=True)
    assert not more and [m["user"] for m in first + rest][:100] == sorted(snapshot.users)
    assert rest[-1] == {"user": None, "connections": 3}
    one, more = page(Snapshot({"x" * 100: (1, None), "y": (1, None)}), None, 10)
    assert len(one) == 1 and more  # at least one, whatever the bound


class Presence(RuleBasedStateMachine):
    """Processes with connections, a backplane of parts under leases, and one watcher.

    The watcher holds what the server sent it; when it is slow, the server's frame is held
    and the next diff merged into it (as :mod:`realtime_app.hub.presence` does)."""

    def __init__(self):
        super().__init__()
        self.rooms = {p: LocalRoom() for p in range(3)}
        self.conns: dict[int, tuple[int, str | None]] = {}  # connection -> (process, user)
        self.kept: dict[int, str] = {}  # the backplane: process -> its part (alive)
        self.next_conn = 0
        self.sent: Snapshot | None = None  # what the server believes the watcher holds
        self.listed = True
        self.held: Diff | None = None
        self.watcher: dict[str, dict] = {}
        self.watcher_count = 0
        self.up_to = 3
        self.slow = False

    def truth(self) -> Snapshot:
        return merge(room.part(0) for room in self.rooms.values())

    @rule(process=st.integers(0, 2), user=st.sampled_from([*USERS, None]))
    def join(self, process, user):
        self.next_conn += 1
        self.conns[self.next_conn] = (process, user)
        self.rooms[process].enter(self.next_conn, user)

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def leave(self, data):
        conn = data.draw(st.sampled_from(sorted(self.conns)))
        process, _ = self.conns.pop(conn)
        self.rooms[process].exit(conn)

    @rule(process=st.integers(0, 2))
    def write(self, process):
        room = self.rooms[process]
        if room:
            self.kept[process] = room.part(0)
        else:
            self.kept.pop(process, None)

    @rule(process=st.integers(0, 2))
    def crash(self, process):
        """kill -9: its connections are gone, its part expires with its lease."""
        for conn in [c for c, (p, _) in self.conns.items() if p == process]:
            del self.conns[conn]
        self.rooms[process] = LocalRoom()
        self.kept.pop(process, None)

    @rule(slow=st.booleans())
    def watcher_speed(self, slow):
        self.slow = slow
        if not slow and self.held is not None:  # its queue drained: the held frame goes
            self._receive(self.held)
            self.held = None

    @rule()
    def flush(self):
        """An interval: every process re-asserts its part (the beat), the server reads the
        merged snapshot and sends the watcher its diff."""
        for process in self.rooms:
            self.write(process)
        snapshot = merge(self.kept.values())
        change = diff(self.sent, snapshot, self.listed, self.up_to)
        self.sent, self.listed = snapshot, not self.up_to or len(snapshot.users) <= self.up_to
        if change is None:
            return
        if self.slow:
            self.held = change if self.held is None else compose(self.held, change)
        else:
            self._receive(change)

    def _receive(self, change):
        params = json.loads(json.dumps(to_params("room", change)))  # over the wire
        self.watcher = apply(self.watcher, params)
        self.watcher_count = params["count"]

    @invariant()
    def the_watcher_holds_the_truth_once_flushed_and_fast(self):
        if self.sent is None or self.held is not None:
            return
        if self.sent != merge(self.kept.values()):
            return  # a change not flushed yet
        expected = self.sent
        assert self.watcher_count == expected.count
        if self.listed:
            assert {u: m["connections"] for u, m in self.watcher.items()} == {
                u: n for u, (n, _) in expected.users.items()
            }
        else:
            assert self.watcher == {}

    @invariant()
    def a_flushed_snapshot_is_the_truth(self):
        if all(self.kept.get(p) == (r.part(0) if r else None) for p, r in self.rooms.items()):
            assert merge(self.kept.values()) == self.truth()


TestPresenceMachine = Presence.TestCase
TestPresenceMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_the_member_set_vectors_shared_with_the_browser_module():
    vectors = json.loads((Path(__file__).parent / "vectors" / "presence.json").read_text())
    members: dict = {}
    for step in vectors["steps"]:
        members = apply(members, step["params"])
        assert members == step["members"]


def test_a_client_keeps_the_reset_sent_before_the_answer_names_the_canonical_channel():
    from realtime_app.wire.session import ClientSession, Notify

    session = ClientSession()
    assert session.book("lot:0042", print, presence=True) == "first"
    params, _, _ = session.subscribe_request("lot:0042")
    assert params["presence"] is True
    reset = {"channel": "lot:42", "count": 1, "anonymous": 0, "joined": [], "left": [], "updated": [], "reset": True}
    reset["members"] = [{"user": "ann", "connections": 1}]
    [event] = session.receive(json.dumps({"jsonrpc": "2.0", "method": "presence", "params": reset}))
    assert isinstance(event, Notify) and session.members["lot:42"] == {"ann": {"user": "ann", "connections": 1}}
    session.subscribed("lot:0042", {"channel": "lot:42"})
    assert session.book("lot:0042", repr, presence=True) == ""  # wanted already
    assert session.book("other", print) == "first" and session.book("other", repr, presence=True) == "again"
    session.closed()
    assert session.members == {}  # a reset comes with the next subscribe
    assert session.unbook("lot:0042") == "lot:42" and session.unbook("other") == "other"
    late = {**reset, "reset": False, "members": []}
    assert session.receive(json.dumps({"jsonrpc": "2.0", "method": "presence", "params": late})) == []


def test_a_view_lists_up_to_its_bound_included_and_zero_is_no_bound():
    """Found by mutation testing: the bound's own size (``<=``) and 0 (no bound) untested."""
    two = Snapshot(users={"ann": (1, None), "bob": (2, None)}, anonymous=1)
    assert view(two, 2) == {
        "count": 3,
        "anonymous": 1,
        "listed": True,
        "members": [{"user": "ann", "connections": 1}, {"user": "bob", "connections": 2}],
    }
    assert view(two, 1) == {"count": 3, "anonymous": 1, "listed": False, "members": []}
    assert view(two, 0)["listed"] is True and len(view(two, 0)["members"]) == 2
    assert view(two, 3)["listed"] is True  # under the bound
