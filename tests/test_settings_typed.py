"""The settings as one typed, frozen object, and its reload rule: a running hub takes new
admission limits when ``REALTIME_APP`` changes (realtime_app.conf.runtime)."""

from __future__ import annotations

import dataclasses

import pytest
from django.test import override_settings

from realtime_app.conf import DEFAULTS
from realtime_app.conf.runtime import settings
from realtime_app.conf.typed import Settings


def test_every_setting_is_one_typed_attribute_and_nothing_else():
    assert [f.name.upper() for f in dataclasses.fields(Settings)] == list(DEFAULTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings().max_batch = 1  # type: ignore[misc]


def test_override_settings_is_seen_and_an_int_given_for_a_float_is_a_float():
    before = settings()
    with override_settings(REALTIME_APP={"ADMISSION_REFILL_PER_S": 3, "MAX_BATCH": 7}):
        now = settings()
        assert (now.max_batch, now.admission_refill_per_s) == (7, 3.0)
        assert isinstance(now.admission_refill_per_s, float)
    assert settings() == before and settings().max_batch == DEFAULTS["MAX_BATCH"]


async def test_a_running_hub_takes_new_admission_limits_at_once(hub):
    """Found: a hub kept the limits it started with; ``override_settings`` (which conf
    promised to honour) changed nothing for a running hub."""
    alice = ("user", "1")
    with override_settings(REALTIME_APP={"ADMISSION_MAX_PER_IDENTITY": 1, "ADMISSION_MAX_RUNNING": 3}):
        assert await hub.gate.admit(alice, 1.0) is None
        refused = await hub.gate.admit(alice, 1.0)
        assert refused is not None and refused.reason == "too_many_in_flight"
        assert hub.pool.max_running == 3
        hub.admission.release(alice)
    assert hub.admission.limits.max_per_identity == DEFAULTS["ADMISSION_MAX_PER_IDENTITY"]
    assert hub.pool.max_running == DEFAULTS["ADMISSION_MAX_RUNNING"]
    assert await hub.gate.admit(alice, 1.0) is None and await hub.gate.admit(alice, 1.0) is None
    hub.admission.release(alice)
    hub.admission.release(alice)


def test_bounds_are_declared_beside_the_fields_and_the_check_reads_them():
    """Validation sits next to the fields (``bounded`` in conf/typed.py), not 500 lines
    apart: the check E002 reads the bounds from the typed object."""
    from realtime_app.checks.configuration import check_settings
    from realtime_app.conf.typed import bounds

    found = bounds()
    assert found["MAX_BATCH"] == (int, 1, None) and found["SIGNED_IN_RESERVE"] == (float, 0, 0.99)
    assert found["ADDRESS_PREFIX_V4"] == (int, 0, 32)
    for bad in ({"MAX_BATCH": 0}, {"MAX_BATCH": 2.5}, {"ADDRESS_PREFIX_V4": 33}, {"HANDSHAKES_PER_S": float("inf")}):
        with override_settings(REALTIME_APP=bad):
            [error] = [m for m in check_settings() if m.id == "realtime_app.E002"]
            assert next(iter(bad)) in error.msg
