"""Fossil deltas in Python (realtime_app.wire.fossil) against vectors made by Fossil's own
C code and by the browser module's vendored codec (tests/vectors/fossil.json): the same
deltas as Fossil's, every delta applied exactly, and a delta for another base refused."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime_app.wire.fossil import DeltaError, apply_delta, create_delta, output_size

VECTORS = json.loads((Path(__file__).parent / "vectors" / "fossil.json").read_text())["vectors"]


def raw(vector: dict, name: str) -> bytes:
    return base64.b64decode(vector[name])


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_the_vectors(vector):
    base, target = raw(vector, "base"), raw(vector, "target")
    assert create_delta(base, target) == raw(vector, "delta_fossil")  # byte for byte Fossil's
    for made in ("delta_fossil", "delta_python", "delta_js"):
        assert apply_delta(base, raw(vector, made)) == target, made
    assert output_size(raw(vector, "delta_fossil")) == len(target)


def test_a_delta_for_another_base_is_refused_never_applied():
    vector = next(v for v in VECTORS if v["name"].startswith("a dashboard state, three"))
    base = bytearray(raw(vector, "base"))
    base[100] ^= 1  # one bit of a region the delta copies
    with pytest.raises(DeltaError, match="checksum"):
        apply_delta(bytes(base), raw(vector, "delta_fossil"))


@pytest.mark.parametrize(
    ("delta", "why"),
    [
        (b"", "newline"),
        (b"5", "newline"),
        (b"5\n5:hel", "insert past the end"),
        (b"5\n3@0,", "copy past the end of the base"),
        (b"5\n2@0;", "copy command not ended"),
        (b"5\n5:hello", "ends without its checksum"),
        (b"5\n5:hello!", "unknown command"),
        (b"3\n5:hello0;", "past the target"),
    ],
)
def test_malformed_deltas_say_why(delta, why):
    with pytest.raises(DeltaError, match=why):
        apply_delta(b"ab", delta)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600), st.binary(max_size=600), st.integers(0, 2**32 - 1))
def test_any_target_round_trips_from_any_base(base, edit, seed):
    rng = random.Random(seed)
    target = bytearray(base)
    for byte in edit[:20]:  # a few edits of the base, or something else entirely
        at = rng.randrange(len(target) + 1)
        target[at:at] = bytes([byte]) * rng.randrange(1, 4)
    if seed % 5 == 0:
        target = bytearray(edit)
    assert apply_delta(base, create_delta(base, bytes(target))) == bytes(target)


def test_a_search_past_its_budget_gives_up_instead_of_spinning():
    """A base of one 16-byte block repeated and a target of a permutation of it: every
    target byte would try 250 candidate blocks (minutes of Python on a megabyte)."""
    import time

    from realtime_app.wire.fossil import TooCostly

    block = bytes(range(65, 81))
    base, target = block * 1024, bytes(reversed(block)) * 256
    started = time.process_time()
    with pytest.raises(TooCostly):
        create_delta(base, target)
    assert time.process_time() - started < 5  # bounded by the budget, not by the input's shape


def test_a_delta_cannot_make_apply_build_a_huge_target_or_read_endless_numbers():
    with pytest.raises(DeltaError, match="over"):
        apply_delta(b"", b"zzzzzz\n1:a0;")  # a 2^36-byte target announced
    with pytest.raises(DeltaError, match="8 digits"):
        apply_delta(b"", b"5\n" + b"1" * 50_000 + b":hello0;")
