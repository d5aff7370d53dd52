import pytest
from hypothesis import given
from hypothesis import strategies as st

from realtime_app.wire.rate import RateBounds, is_rate_channel, parse_rate, rate_channel

BOUNDS = RateBounds(1000, 250, 60000)


def test_rate_channel_names_the_default_by_its_base():
    assert rate_channel("atelier:load", 1000, 1000) == "atelier:load"
    assert rate_channel("atelier:load", 2000, 1000) == "atelier:load:2000"


@pytest.mark.parametrize("ms", [0, -5, 1.5, True, "100"])
def test_rate_channel_refuses_non_cadences(ms):
    with pytest.raises(ValueError):
        rate_channel("a", ms, 1000)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("atelier:load", True),
        ("atelier:load:2000", True),
        ("atelier:load:0100", True),
        ("atelier:load:", False),
        ("atelier:load:abc", False),
        ("atelier:load:-5", False),
        ("atelier:load:1e3", False),
        ("atelier:load:+5", False),
        ("atelier:load: 5", False),
        ("atelier:load:５", False),  # full-width digit
        ("atelier:load:١٢٣", False),  # Arabic-Indic digits
        ("atelier:load:²", False),
        ("atelier:load:" + "9" * 10, False),
        ("atelier:load:" + "9" * 10_000, False),
        ("atelier:loader", False),
        ("atelier:load:2000:3", False),
        ("atelier", False),
        ("other:load:2000", False),
    ],
)
def test_is_rate_channel(name, expected):
    assert is_rate_channel(name, "atelier:load") is expected
    assert (parse_rate(name, "atelier:load", BOUNDS) is not None) is expected


def test_parse_rate_clamps_into_the_bounds():
    assert parse_rate("atelier:load", "atelier:load", BOUNDS) == 1000
    assert parse_rate("atelier:load:10", "atelier:load", BOUNDS) == 250
    assert parse_rate("atelier:load:0", "atelier:load", BOUNDS) == 250
    assert parse_rate("atelier:load:2000", "atelier:load", BOUNDS) == 2000
    assert parse_rate("atelier:load:999999999", "atelier:load", BOUNDS) == 60000


@given(st.text(max_size=40))
def test_any_suffix_is_refused_or_clamped_never_crashes(suffix):
    name = f"atelier:load:{suffix}"
    ms = parse_rate(name, "atelier:load", BOUNDS)
    if ms is None:
        assert not is_rate_channel(name, "atelier:load")
    else:
        assert suffix.isascii() and suffix.isdigit()
        assert BOUNDS.min <= ms <= BOUNDS.max


@given(st.integers(min_value=1, max_value=999_999_999))
def test_rate_channel_and_parse_rate_round_trip(ms):
    name = rate_channel("demo:clock", ms, 1000)
    assert parse_rate(name, "demo:clock", (1000, 1, 10**9)) == ms
