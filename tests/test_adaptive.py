"""AdaptiveRate, the Python twin, against the vectors the browser module passes too."""

import json
from pathlib import Path

import pytest

from realtime_app.client.adaptive import AdaptiveRate, derive_ladder

VECTORS = json.loads((Path(__file__).parent / "vectors" / "adaptive.json").read_text())["cases"]


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_vector(case):
    rate = AdaptiveRate(case["interval_ms"], **case.get("options", {}))
    if "ladder" in case:
        assert rate.ladder == case["ladder"]
    for step in case["steps"]:
        decide = rate.note_frame if step["op"] == "frame" else rate.check_starvation
        assert (decide(step["t"]), rate.interval_ms) == (step["decision"], step["interval_ms"]), step
    if "healthy_count_after" in case:
        assert rate.healthy_count == case["healthy_count_after"]


def test_derive_ladder():
    assert derive_ladder(1000) == [1000, 2000, 4000, 8000, 16000, 32000, 60000]
    assert derive_ladder(250, 1000) == [250, 500, 1000]
    assert derive_ladder(70000, 60000) == [70000]
    with pytest.raises(ValueError):
        derive_ladder(0)


@pytest.mark.parametrize(
    "kwargs", [{"healthy_factor": 2, "starvation_factor": 1.5}, {"healthy_factor": 0.5}, {"recovery_window": 0}]
)
def test_invalid_options(kwargs):
    with pytest.raises(ValueError):
        AdaptiveRate(1000, **kwargs)
