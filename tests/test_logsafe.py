"""Client strings in logs, outages as edges, and the nearest running cadence."""

from __future__ import annotations

import logging

import pytest

from realtime_app.observability.logsafe import Outage, safe
from realtime_app.wire.rate import nearest_cadence


def test_client_strings_cannot_forge_a_log_line():
    assert safe("ping\n2026-01-01 ERROR forged") == "ping\\n2026-01-01 ERROR forged"
    assert safe("\ud800") == "\\ud800"
    assert safe("x" * 500, 10) == "x" * 10 + "…"


def test_an_outage_is_logged_once_going_once_back_and_reminded_rarely(caplog):
    now = [0.0]
    outage = Outage(logging.getLogger("t"), "thing", remind_s=60, settle_s=2, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "t"):
        assert outage.succeeded() is False
        for t in range(0, 100):  # 100 s of failures, one per second
            now[0] = t
            outage.failed(ConnectionError("refused"))
        assert outage.down and outage.failures == 100
        now[0] = 100
        assert outage.succeeded() is True  # re-assert now
        now[0] = 100.5
        outage.failed(ConnectionError("stale pooled connection"))  # a flap: the same outage
        now[0] = 101
        assert outage.succeeded() is True
        now[0] = 104
        assert outage.succeeded() is False and not outage.down
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "thing unreachable: ConnectionError: refused",
        "thing still unreachable after 60 s (61 operations failed)",
        "thing reachable again after 101.0 s (101 operations failed meanwhile)",
    ]
    assert outage.outages == 1


def test_nearest_cadence():
    assert nearest_cadence(500, [200, 2000]) == 200
    assert nearest_cadence(1500, [200, 2000]) == 2000
    assert nearest_cadence(1100, [200, 2000]) == 200  # a tie goes to the faster one
    with pytest.raises(ValueError):
        nearest_cadence(1000, [])
