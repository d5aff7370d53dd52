"""Closing runs to its end: :func:`realtime_app.cancellation.uninterrupted` under any
schedule of cancels of its caller, before its first step included. A close cut in half
left Redis connections open that nothing owned (tests/test_backplane_wire.py shows it on
a real server); here the pure core, every interleaving hypothesis finds."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime_app.cancellation import cancel_and_wait, uninterrupted


class Closing:
    """A close of ``steps`` suspension points; what it reached is kept."""

    def __init__(self, steps: int, fails: bool) -> None:
        self.steps, self.fails = steps, fails
        self.began = self.ended = False

    async def close(self) -> str:
        self.began = True
        for _ in range(self.steps):
            await asyncio.sleep(0)
        self.ended = True
        if self.fails:
            raise OSError("the close failed")
        return "closed"


async def scenario(steps: int, fails: bool, cancels: list[int], repeated: bool) -> None:
    closing = Closing(steps, fails)

    swallowed: list[bool] = []

    async def caller() -> str:
        result = await uninterrupted(closing.close())
        swallowed.append(asyncio.current_task().cancelling() > 0)  # a cancel came, and no CancelledError
        return result

    before = asyncio.all_tasks()
    task = asyncio.get_running_loop().create_task(caller())
    loop_steps = 0
    for at in sorted(cancels):
        while loop_steps < at and not task.done():
            await asyncio.sleep(0)
            loop_steps += 1
        if task.done():
            break
        if repeated:
            await cancel_and_wait(task, every_s=0.001)  # as the product stops a task: cancel upon cancel
        else:
            task.cancel()
    await asyncio.wait([task])
    leftover = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not leftover, f"tasks left: {leftover}"
    assert closing.ended == closing.began  # begun means finished, whatever the caller heard
    assert swallowed in ([], [False]), "a cancel was swallowed"
    if not closing.began:
        assert task.cancelled()  # cancelled before its first step: nothing begun, nothing to close
    elif task.cancelled():
        assert cancels  # the cancel passed on, after the close
    elif fails:
        assert isinstance(task.exception(), OSError)
    else:
        assert task.result() == "closed"


@settings(max_examples=300, deadline=None)
@given(
    steps=st.integers(0, 6),
    fails=st.booleans(),
    cancels=st.lists(st.integers(0, 8), max_size=4),
    repeated=st.booleans(),
)
def test_a_close_once_begun_is_finished_under_any_cancels(
    steps: int, fails: bool, cancels: list[int], repeated: bool
) -> None:
    asyncio.run(scenario(steps, fails, cancels, repeated))


async def test_the_caller_hears_the_cancel_after_the_close_ended() -> None:
    """Under ``asyncio.timeout`` the caller's bound still reads as a timeout, once the
    close is done."""
    closing = Closing(50, fails=False)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await uninterrupted(closing.close())
    assert closing.ended
    assert asyncio.current_task().cancelling() == 0  # the bound's cancel consumed, none left pending
