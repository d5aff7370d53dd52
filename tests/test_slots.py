"""The pool's slot accounting (realtime_app.inbound.slots): every admitted request released exactly
once whatever ends it, and the asyncio shell keeping that promise for a task cancelled
before its first step."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from realtime_app.inbound.admission import Admission, AdmissionLimits, Job
from realtime_app.inbound.slots import PoolCore
from realtime_app.inbound.workers import Call, RequestPool
from tests.support.waiting import eventually


@dataclass(eq=False)
class Ticket:
    owner: Any
    identity: Hashable
    merged: bool
    cancellable: bool = True
    released: bool = False


class PoolBooks(RuleBasedStateMachine):
    """Admits, merges, starts, task ends (run, raised, or cancelled before starting),
    connection closes and process stops, in any order: the admission books always equal
    what the pool holds, and end at zero."""

    @initialize(max_running=st.integers(0, 3), per_identity=st.integers(0, 4), anonymous_share=st.integers(0, 2))
    def setup(self, max_running: int, per_identity: int, anonymous_share: int) -> None:
        self.admission = Admission(AdmissionLimits(max_pending=6, max_per_identity=per_identity, bucket_capacity=0))
        self.core: PoolCore[Ticket] = PoolCore(self.admission, max_running, anonymous_share)
        self.started: list[Job[Ticket]] = []  # jobs whose task has not ended
        self.tickets: list[Ticket] = []
        self.closed = False

    def _start(self, jobs: list[Job[Ticket]]) -> None:
        self.started += jobs

    @rule(
        owner=st.sampled_from("abc"),
        identity=st.sampled_from(["u1", "u2", ("address", "x"), ("address", "y")]),
        key=st.sampled_from([None, "k1", "k2"]),
        sync=st.booleans(),
    )
    def submit(self, owner: str, identity: Hashable, key: str | None, sync: bool) -> None:
        merged = self.core.would_merge(key, 1.0, 2.0)
        if self.closed or self.admission.admit(identity, 1.0, merged=merged) is not None:
            return
        ticket = Ticket(owner, identity, merged, cancellable=not sync)
        self.tickets.append(ticket)
        self._start(self.core.submit(ticket, key, 1.0, 2.0, serial=key == "k1"))  # k1: one at a time

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def task_ends(self, data: st.DataObject) -> None:
        """A task ends: answered, raised, or cancelled before or after its first step —
        the shell's done callback calls ``finished`` the same way for each."""
        job = data.draw(st.sampled_from(self.started))
        self.started.remove(job)
        self._start(self.core.finished(job))

    @rule(owner=st.sampled_from("abc"))
    def connection_closes(self, owner: str) -> None:
        removed, cancel, start = self.core.abandon(owner)
        self._start(start)
        assert all(t.owner == owner and t.released for t in removed)
        for job in cancel:  # cancelled: ends later through task_ends, never twice
            assert job in self.started

    @rule()
    def process_stops(self) -> None:
        self.closed = True
        _, cancel = self.core.close()
        assert set(cancel) == set(self.started)

    @invariant()
    def books_match(self) -> None:
        if not hasattr(self, "core"):
            return
        live = [t for t in self.tickets if not t.released]
        assert self.admission.pending == sum(1 for t in live if not t.merged)
        per_identity: dict[Hashable, int] = {}
        for t in live:
            per_identity[t.identity] = per_identity.get(t.identity, 0) + 1
        for identity, state in self.admission._identities.items():
            assert state.pending == per_identity.get(identity, 0)
        assert len(self.core.running) == len(self.started)
        if self.core.max_running > 0:
            assert len(self.core.running) <= self.core.max_running
        assert self.core.released == sum(1 for t in self.tickets if t.released)
        # Every job holds a global slot while it waits or runs.
        for job in [*self.core.queue, *self.core.running]:
            assert any(not t.merged for t in job.items if not t.released) or not job.items
        # A serial key never runs twice at once...
        serial = [job.key for job in self.core.running if job.serial]
        assert len(serial) == len(set(serial))
        # Anonymous identities together never run past their share...
        anonymous = sum(1 for job in self.core.running if isinstance(job.identity, tuple))
        assert anonymous == self.core.anonymous_running
        if self.core.anonymous_share:
            assert anonymous <= self.core.anonymous_share
        # ...and nothing waits that could run: with room in the pool, every waiting
        # identity's next job is a serial one whose key runs, or an anonymous one while
        # their share is taken.
        if not self.closed and (self.core.max_running == 0 or len(self.core.running) < self.core.max_running):
            full = bool(self.core.anonymous_share) and anonymous >= self.core.anonymous_share
            for identity, queue in self.core.queue._queues.items():
                assert self.core.queue.blocked(queue[0]) or (full and isinstance(identity, tuple))

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        self.process_stops()
        while self.started:
            self._start(self.core.finished(self.started.pop()))
        assert self.admission.pending == 0
        assert all(t.released for t in self.tickets)
        assert all(state.pending == 0 for state in self.admission._identities.values())


TestPoolBooks = PoolBooks.TestCase
TestPoolBooks.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_finishing_a_job_twice_is_a_bug_not_a_second_release():
    admission = Admission(AdmissionLimits(bucket_capacity=0))
    core: PoolCore[Ticket] = PoolCore(admission, 1)
    assert admission.admit("u") is None
    [job] = core.submit(Ticket("a", "u", False))
    core.finished(job)
    with pytest.raises(ValueError):
        core.finished(job)
    assert admission.pending == 0


def test_the_identity_with_nothing_running_is_served_first():
    """Fair shares: one identity's backlog delays another's first request by one slot."""
    admission = Admission(AdmissionLimits(max_per_identity=0, bucket_capacity=0))
    core: PoolCore[Ticket] = PoolCore(admission, 2)
    started = []
    for _ in range(10):
        admission.admit("attacker")
        started += core.submit(Ticket("x", "attacker", False))
    assert [job.identity for job in started] == ["attacker", "attacker"]
    admission.admit("user")
    assert core.submit(Ticket("y", "user", False)) == []  # both slots busy
    [next_job] = core.finished(started[0])
    assert next_job.identity == "user"  # not the attacker's eight waiting ones


async def test_a_job_cancelled_before_its_first_step_gives_its_slots_back():
    """The wedge: a connection closing right after its batch cancels job tasks that never
    ran a step; their slots must come back all the same."""
    admission = Admission(AdmissionLimits(bucket_capacity=0))
    started = asyncio.Event()

    async def execute(method: str, params: Any) -> tuple[bool, Any]:
        started.set()
        await asyncio.sleep(3600)
        return True, None

    pool = RequestPool(admission, 64)
    owner = object()
    for _ in range(10):
        assert admission.admit(("address", "1.2.3.4")) is None
        pool.submit(Call(owner, execute, "demo.sleep", {}, ("address", "1.2.3.4"), False))
    assert pool.running == 10 and not started.is_set()  # created, not one step taken
    pool.abandon(owner)  # in the same loop iteration: cancelled before their first step
    await eventually(lambda: pool.running == 0, 5, "the cancelled tasks ended")
    assert not started.is_set()
    assert (pool.running, pool.waiting, admission.pending) == (0, 0, 0)


async def test_a_job_whose_execution_raises_is_answered_and_released():
    admission = Admission(AdmissionLimits(bucket_capacity=0))

    async def execute(method: str, params: Any) -> tuple[bool, Any]:
        raise RuntimeError("a bug outside the handler")

    pool = RequestPool(admission, 4)
    assert admission.admit("u") is None
    call = Call(object(), execute, "m", {}, "u", False)
    pool.submit(call)
    ok, error = await asyncio.wait_for(call.future, 5)
    assert not ok and error["code"] == -32603
    assert admission.pending == 0 and pool.running == 0


def test_anonymous_identities_together_keep_to_their_share_of_the_pool():
    """Found: ten addresses calling a 5 s method filled the 64-slot pool, and a signed-in
    user's calls waited behind them (fair among identities, but ten outweigh one). With
    a share of 2 of 3 slots, the third address waits and a user runs at once."""
    admission = Admission(AdmissionLimits(max_pending=10, max_per_identity=0, bucket_capacity=0))
    core: PoolCore[Ticket] = PoolCore(admission, 3, anonymous_share=2)
    started = []
    for n in range(3):
        identity = ("address", str(n))
        assert admission.admit(identity, 1.0) is None
        started += core.submit(Ticket(f"c{n}", identity, False))
    assert [job.identity for job in started] == [("address", "0"), ("address", "1")]  # the third waits
    assert admission.admit("user", 1.0) is None
    [user_job] = core.submit(Ticket("u", "user", False))
    assert user_job.identity == "user"  # the reserved slot
    assert [job.identity for job in core.finished(started[0])] == [("address", "2")]


def _pool(max_running: int, anonymous_share: int = 0) -> tuple[Admission, PoolCore[Ticket]]:
    admission = Admission(AdmissionLimits(max_pending=20, max_per_identity=0, bucket_capacity=0))
    return admission, PoolCore(admission, max_running, anonymous_share)


def _submit(admission: Admission, core: PoolCore[Ticket], identity: Hashable) -> list[Job[Ticket]]:
    assert admission.admit(identity, 1.0) is None
    return core.submit(Ticket(str(identity), identity, False))


def test_a_pool_lowered_while_full_starts_nothing_until_under_its_new_bound():
    """The settings may lower the pool while more run than the new bound (gate.py): no
    job starts until fewer run than that. Found by mutation testing: ``!=`` for ``<``
    passed, and would have started jobs past the bound — and after ``close()``."""
    admission, core = _pool(3)
    running = [job for n in range(3) for job in _submit(admission, core, f"u{n}")]
    assert len(running) == 3 and _submit(admission, core, "w") == []
    core.max_running = 1
    assert core.finished(running[0]) == [] and core.finished(running[1]) == []  # 1 runs: at the bound
    assert [job.identity for job in core.finished(running[2])] == ["w"]


def test_a_closed_pool_starts_nothing_more():
    admission, core = _pool(2)
    running = _submit(admission, core, "a") + _submit(admission, core, "b")
    removed, to_cancel = core.close()
    assert removed == [] and set(to_cancel) == set(running)
    assert admission.admit("c", 1.0) is None
    assert core.submit(Ticket("c", "c", False)) == [] and core.finished(running[0]) == []


def test_an_anonymous_share_lowered_while_over_it_starts_no_anonymous_job():
    admission, core = _pool(5, anonymous_share=3)
    running = [job for n in range(3) for job in _submit(admission, core, ("address", str(n)))]
    assert len(running) == 3 and _submit(admission, core, ("address", "late")) == []
    core.anonymous_share = 1
    assert core.finished(running[0]) == [] and core.finished(running[1]) == []  # 1 anonymous runs: full
    assert [job.identity for job in core.finished(running[2])] == [("address", "late")]


def test_an_identity_whose_jobs_ended_is_idle_again_and_waits_its_turn_in_order():
    """Busy counts go back to zero: an identity whose job ran and ended is as idle as one
    that never ran, so the two are served in arrival order."""
    admission, core = _pool(1)
    [first] = _submit(admission, core, "a")
    assert core.finished(first) == []
    [holder] = _submit(admission, core, "c")
    assert _submit(admission, core, "a") == [] and _submit(admission, core, "b") == []  # a, then b, wait
    assert [job.identity for job in core.finished(holder)] == ["a"]
    assert core.busy("c") == 0 and core.busy("a") == 1
