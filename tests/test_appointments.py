"""The turns a refused crowd is given (``inbound.appointments``): spaced at the rate the
resource frees up, never sooner than it could, never past the horizon."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from realtime_app.inbound.appointments import Appointments

steps = st.lists(
    st.tuples(
        st.floats(0, 5),  # time passed since the last refusal
        st.floats(0.001, 2),  # spacing
        st.floats(0, 3),  # earliest
        st.floats(0, 0.999),  # u
    ),
    max_size=60,
)


@given(steps, st.floats(0.5, 30))
def test_turns_are_spaced_never_early_and_never_past_the_horizon(refusals, horizon):
    book = Appointments(horizon)
    now, booked = 100.0, []  # (turn, spacing) of the turns given one by one
    for passed, spacing, earliest, u in refusals:
        now += passed
        before = book.last
        wait = book.next(now, spacing, earliest, u)
        assert wait >= earliest  # never sooner than the resource could take it
        assert wait <= max(horizon + 1e-9, earliest)
        if book.last == before:  # past the horizon: drawn at random, the book unmoved
            assert max(earliest, before + spacing - now) > horizon
        else:
            booked.append((now + wait, spacing))
    for (first, _), (second, spacing) in zip(booked, booked[1:], strict=False):
        assert second - first >= spacing - 1e-6  # one after another, as the resource frees up


def test_a_crowd_refused_at_once_is_told_one_turn_each():
    book = Appointments(horizon_s=1.0)
    waits = [book.next_ms(50.0, 0.2, 0.2, 0.5) for _ in range(7)]
    assert waits[:5] == [200, 400, 600, 800, 1000]
    assert waits[5:] == [600, 600]  # past the horizon: spread over it (u = 0.5), not later
    assert book.next_ms(52.0, 0.2, 0.2, 0.0) == 200  # the crowd gone: the next is told the soonest


def test_a_turn_is_a_millisecond_at_least():
    assert Appointments(1.0).next_ms(0.0, 0.0, 0.0, 0.0) == 1
