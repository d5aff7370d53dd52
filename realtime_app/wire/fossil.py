"""Fossil deltas (the format of the Fossil SCM, used by Centrifugo's delta compression):
the difference between two byte strings as a compact, mostly-text byte string.

A delta is ``<target size>\\n`` followed by commands, all numbers in Fossil's base 64
(``0-9 A-Z _ a-z ~``): ``<n>@<offset>,`` copies ``n`` bytes of the base from ``offset``;
``<n>:<bytes>`` inserts the next ``n`` bytes as they are; ``<checksum>;`` ends it with the
checksum of the whole target (a sum of its big-endian 32-bit words), so that a wrong or
damaged base is detected, never applied silently.

No maintained implementation exists for Python (the ``fossil-delta`` wheel was last built
in 2017 and does not build on Python 3.11), hence this one. It encodes as Fossil's
``delta_create`` does (a 16-byte rolling hash over landmarks of the base, matches extended
both ways, a copy only where it is shorter than the bytes it replaces), and
``tests/test_fossil.py`` checks it against vectors made by Fossil's own C code and by the
JavaScript port the browser module ships (``static/realtime_app/vendor/fossil-delta.js``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

__all__ = ["DeltaError", "TooCostly", "apply_delta", "create_delta", "output_size"]

NHASH = 16  # the rolling hash's window
#: Blocks of the base tried per position of the target (Fossil's own bound: repetitive
#: input, one short phrase repeated, would make the search quadratic).
MAX_CANDIDATES = 250
DIGITS = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~"
VALUES = {c: i for i, c in enumerate(DIGITS)}


class DeltaError(ValueError):
    """A delta that does not apply to this base: malformed, or made from another base."""


class TooCostly(Exception):
    """The search went past its work budget (hostile or repetitive input): send it whole."""


#: Candidate checks and bytes compared per byte of target before the search gives up: a
#: few per byte in the usual case; a crafted input would make Fossil's search try 250 per
#: byte, which on a megabyte is minutes of Python.
WORK_PER_BYTE = 8
#: Digits in one number of a delta: 8 base-64 digits reach 2^48, past any real size.
MAX_DIGITS = 8
#: The largest target ``apply_delta`` builds unless told otherwise.
MAX_OUTPUT = 16 * 1024 * 1024


def _put_int(value: int, out: bytearray) -> None:
    if value == 0:
        out += b"0"
        return
    digits = bytearray()
    while value:
        digits.append(DIGITS[value & 0x3F])
        value >>= 6
    digits.reverse()
    out += digits


def _digit_count(value: int) -> int:
    count, limit = 1, 64
    while value >= limit:
        count, limit = count + 1, limit << 6
    return count


def checksum(data: bytes | bytearray) -> int:
    """The sum of ``data``'s big-endian 32-bit words (the last one zero-padded), mod 2³²."""
    padded = bytes(data) + b"\0" * (-len(data) % 4)
    return int(sum(struct.unpack(f">{len(padded) // 4}I", padded))) & 0xFFFFFFFF


def _window_hash(data: bytes, at: int) -> tuple[int, int]:
    """(a, b) of the rolling hash over ``data[at:at + NHASH]``: the sum of its bytes, and the
    sum of its running sums (bytes unsigned, as in Fossil built where ``char`` is)."""
    a = b = data[at]
    for offset in range(1, NHASH):
        a += data[at + offset]
        b += a
    return a & 0xFFFF, b & 0xFFFF


def _forward(src: bytes, x: int, out: bytes, y: int) -> int:
    """How many bytes match from ``src[x]`` and ``out[y]`` on (memcmp in chunks, then bytes)."""
    limit = min(len(src) - x, len(out) - y)
    matched, step = 0, 256
    while matched < limit:
        n = min(step, limit - matched)
        if src[x + matched : x + matched + n] == out[y + matched : y + matched + n]:
            matched += n
            continue
        if n <= 8:
            while matched < limit and src[x + matched] == out[y + matched]:
                matched += 1
            return matched
        step = n // 8
    return matched


def cpu_bound(max_seconds: float | None, size: int) -> Callable[[], None]:
    """A check to call as the search goes: it raises :class:`TooCostly` once this thread
    spent ``max_seconds`` of CPU since (None: never). CPU time of this thread — the event
    loop's — is what the input costs, not a preemption by another process on a loaded
    machine."""
    if max_seconds is None:
        return lambda: None
    deadline = time.thread_time() + max_seconds

    def in_time() -> None:
        if time.thread_time() >= deadline:  # pragma: no mutate (>: the same but at one float instant)
            raise TooCostly(f"longer than {max_seconds} s for a {size}-byte target")

    return in_time


def create_delta(
    base: bytes, target: bytes, work_per_byte: int = WORK_PER_BYTE, max_seconds: float | None = None
) -> bytes:
    """The delta that makes ``target`` out of ``base``; :class:`TooCostly` when the search
    needs more than ``work_per_byte`` candidate checks (and bytes compared) per target byte,
    or — with ``max_seconds`` — more CPU time than that: a bound on the time it holds its thread
    (the event loop's, for the fan-out), whatever the input's shape or size."""
    budget = work_per_byte * len(target) + 4096
    in_time = cpu_bound(max_seconds, len(target))

    out = bytearray()
    _put_int(len(target), out)
    out += b"\n"
    len_src, len_out = len(base), len(target)
    if len_src <= NHASH:  # too short to copy from: one insert
        _literal(target, 0, len_out, out)
        _put_int(checksum(target), out)
        out += b";"
        return bytes(out)
    slots = len_src // NHASH
    landmark = [-1] * slots  # hash slot -> the last block of the base with that hash
    collide = [-1] * slots  # block -> the previous block in the same slot
    for at in range(0, len_src - NHASH, NHASH):
        if not at % (NHASH * 256):
            in_time()
        a, b = _window_hash(base, at)
        slot = (a | (b << 16)) % slots
        collide[at // NHASH] = landmark[slot]
        landmark[slot] = at // NHASH
    start = 0  # everything before target[start] is encoded
    steps = 0  # candidates tried: the clock is read every 16
    while start + NHASH < len_out:
        a, b = _window_hash(target, start)
        i = 0
        best_count = best_offset = best_literal = 0
        while True:
            block = landmark[(a | (b << 16)) % slots]
            tried = 0
            while block >= 0 and tried < MAX_CANDIDATES:
                tried += 1
                source = block * NHASH
                forward = _forward(base, source, target, start + i)
                back = 0
                while back + 1 < source and back + 1 <= i and base[source - back - 1] == target[start + i - back - 1]:
                    back += 1
                budget -= 1 + back + forward // 64
                steps += 1
                if not steps % 16:
                    in_time()
                if budget < 0:
                    raise TooCostly(f"more than {work_per_byte} steps per byte of a {len_out}-byte target")
                count = forward + back
                cost = _digit_count(i - back) + _digit_count(count) + _digit_count(source - back) + 3
                if count >= cost and count > best_count:  # shorter than the bytes it stands for
                    best_count, best_offset, best_literal = count, source - back, i - back
                block = collide[block]
            if best_count > 0:
                if best_literal > 0:
                    _literal(target, start, best_literal, out)
                    start += best_literal
                start += best_count
                _put_int(best_count, out)
                out += b"@"
                _put_int(best_offset, out)
                out += b","
                break
            if start + i + NHASH >= len_out:  # the end of the target, no match: the rest as it is
                _literal(target, start, len_out - start, out)
                start = len_out
                break
            if not i % 256:
                in_time()
            old, new = target[start + i], target[start + i + NHASH]
            a = (a - old + new) & 0xFFFF
            b = (b - NHASH * old + a) & 0xFFFF
            i += 1
    if start < len_out:
        _literal(target, start, len_out - start, out)
    _put_int(checksum(target), out)
    out += b";"
    return bytes(out)


def _literal(target: bytes, at: int, n: int, out: bytearray) -> None:
    _put_int(n, out)
    out += b":"
    out += target[at : at + n]


def _get_int(delta: bytes, at: int) -> tuple[int, int]:
    """The base-64 number at ``delta[at]`` and the index past it."""
    value = 0
    start = at
    while at < len(delta) and (digit := VALUES.get(delta[at])) is not None:
        if at - start >= MAX_DIGITS:
            raise DeltaError("a number of more than 8 digits")
        value = (value << 6) + digit
        at += 1
    return value, at


def output_size(delta: bytes) -> int:
    """The size of the target a delta makes (its first line)."""
    size, at = _get_int(delta, 0)
    if at >= len(delta) or delta[at : at + 1] != b"\n":
        raise DeltaError("the target size is not followed by a newline")
    return size


def apply_delta(base: bytes, delta: bytes, max_output: int = MAX_OUTPUT) -> bytes:
    """The target ``delta`` makes out of ``base``; :class:`DeltaError` when it does not apply
    (or would make more than ``max_output`` bytes)."""
    limit = output_size(delta)
    if limit > max_output:
        raise DeltaError(f"a target of {limit} bytes, over {max_output}")
    at = delta.index(b"\n") + 1
    out = bytearray()
    while at < len(delta):
        count, at = _get_int(delta, at)
        command = delta[at : at + 1]
        at += 1
        if command == b"@":
            offset, at = _get_int(delta, at)
            if delta[at : at + 1] != b",":
                raise DeltaError("a copy command not ended by ','")
            at += 1
            if len(out) + count > limit:
                raise DeltaError("a copy past the target's size")
            if offset + count > len(base):
                raise DeltaError("a copy past the end of the base")
            out += base[offset : offset + count]
        elif command == b":":
            if len(out) + count > limit:
                raise DeltaError("an insert past the target's size")
            if at + count > len(delta):
                raise DeltaError("an insert past the end of the delta")
            out += delta[at : at + count]
            at += count
        elif command == b";":
            if count != checksum(out):
                raise DeltaError("bad checksum: the delta was made from another base")
            if len(out) != limit:
                raise DeltaError("the target's size differs from the one announced")
            return bytes(out)
        else:
            raise DeltaError(f"unknown command {command!r}")
    raise DeltaError("the delta ends without its checksum")
