import re

from hypothesis import given
from hypothesis import strategies as st

from realtime_app.wire.names import group_name

VALID = re.compile(r"^[A-Za-z0-9\-_.]{1,99}$")


@given(st.text(min_size=1, max_size=300))
def test_group_names_are_valid_channels_group_names(name):
    assert VALID.match(group_name(name))


@given(st.text(min_size=1, max_size=60), st.text(min_size=1, max_size=60))
def test_distinct_channels_get_distinct_groups(a, b):
    if a != b:
        assert group_name(a) != group_name(b)


def test_tricky_pairs_do_not_collide():
    pairs = [("a:b", "a.b"), ("a_b", "a__b"), ("a_2e", "a.")]
    for a, b in pairs:
        assert group_name(a) != group_name(b)
    assert group_name("demo:clock:2000") == "rt.c.demo.clock.2000"


def test_long_names_are_hashed_deterministically():
    long = "x" * 500
    assert group_name(long) == group_name(long)
    assert group_name(long).startswith("rt.h.")
    assert group_name(long) != group_name(long + "y")
