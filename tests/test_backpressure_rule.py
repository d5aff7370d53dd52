"""The pure rule: decide_send (docs/backpressure.md)."""

import tracemalloc

import pytest

from realtime_app.outbound.backpressure import CLOSE, DROP, SEND, BackpressureConfig, DropState, decide_send

MIB = 1024 * 1024


def test_under_the_threshold_sends_and_decays_the_balance():
    config, state = BackpressureConfig(), DropState(balance=2)
    assert decide_send(0, config, state) is SEND
    assert decide_send(4 * MIB, config, state) is SEND  # at the threshold: still sent
    assert decide_send(10, config, state) is SEND
    assert state.balance == 0
    assert decide_send(10, config, state) is SEND and state.balance == 0  # never below zero


def test_drop_adds_to_the_balance_and_closes_at_the_limit():
    config, state = BackpressureConfig(max_backpressure=100, close_after_drops=3), DropState()
    assert [decide_send(101, config, state) for _ in range(2)] == [DROP, DROP]
    assert decide_send(50, config, state) is SEND and state.balance == 1
    assert decide_send(101, config, state) is DROP
    assert decide_send(101, config, state) is CLOSE
    assert state.drops == 4


def test_an_oscillating_queue_is_closed_by_the_balance_not_a_streak():
    config, state = BackpressureConfig(max_backpressure=100, close_after_drops=10), DropState()
    decisions = []
    for i in range(100):  # refuses two frames for each one it accepts
        decisions.append(decide_send(50 if i % 3 == 0 else 150, config, state))
        if decisions[-1] is CLOSE:
            break
    assert decisions[-1] is CLOSE


def test_close_policy_closes_at_the_first_overrun():
    config, state = BackpressureConfig(max_backpressure=100, policy="close"), DropState()
    assert decide_send(100, config, state) is SEND
    assert decide_send(101, config, state) is CLOSE


def test_zero_disables_the_guard_and_the_close():
    assert decide_send(10**12, BackpressureConfig(max_backpressure=0), DropState()) is SEND
    config, state = BackpressureConfig(max_backpressure=1, close_after_drops=0), DropState()
    assert {decide_send(2, config, state) for _ in range(5000)} == {DROP}


@pytest.mark.parametrize("kwargs", [{"max_backpressure": -1}, {"policy": "drop-oldest"}, {"close_after_drops": -5}])
def test_invalid_settings(kwargs):
    with pytest.raises(ValueError):
        BackpressureConfig(**kwargs)


def test_nominal_path_allocates_nothing():
    config, state = BackpressureConfig(), DropState()
    decide_send(0, config, state)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(1000):
            decide_send(100, config, state)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = [
        s for s in after.compare_to(before, "filename") if "backpressure.py" in str(s.traceback) and s.size_diff > 0
    ]
    assert not grown


def test_the_guards_defaults_are_the_settings_defaults():
    """One home for the defaults: conf.DEFAULTS (the pure rule keeps a copy, so that the
    clients' twin imports nothing of settings)."""
    from realtime_app.conf import DEFAULTS
    from realtime_app.outbound.backpressure import BackpressureConfig

    config = BackpressureConfig()
    assert (config.max_backpressure, config.policy, config.close_after_drops) == (
        DEFAULTS["MAX_BACKPRESSURE"],
        DEFAULTS["BACKPRESSURE_POLICY"],
        DEFAULTS["CLOSE_AFTER_DROPS"],
    )
