"""The worst a publication can make the delta search cost the event loop: crafted and
ordinary inputs through the server's own path (:class:`realtime_app.wire.deltas.ChannelDeltas`),
with the time bound (``MAX_DELTA_SECONDS``) and without it, side by side in one run.

Inputs, each a base publication then the next one, at sizes up to the 64 KiB past which
no delta is tried:

* ``permuted`` — a base of one 16-byte block repeated, the next a permutation of it (every
  target byte tries 250 candidate blocks: the crafted attack);
* ``shifted`` — a repetitive base, the next shifted by one byte (long back-matches);
* ``random`` — random hex (no match anywhere);
* ``dashboard`` — a 2.3 KiB state with three fields changed (the ordinary case).

For each: the CPU time of ``frames()`` (``time.thread_time``, the thread the loop runs
on), the worst of ``--repeat`` runs, and whether a delta was built.

Usage:  python bench/delta_search.py [--repeat 5] [--sizes 2048 16384 65000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realtime_app.wire import deltas as wire_deltas
from realtime_app.wire.deltas import ChannelDeltas
from realtime_app.wire.protocol import notification_text


def permuted(size: int) -> tuple[str, str]:
    block = "ABCDEFGHIJKLMNOP"
    return json.dumps({"s": block * (size // 16)}), json.dumps({"s": block[::-1] * (size // 16)})


def shifted(size: int) -> tuple[str, str]:
    text = "abcabcabd" * (size // 9)
    return json.dumps({"s": text}), json.dumps({"s": "x" + text[:-1]})


def randomized(size: int) -> tuple[str, str]:
    return json.dumps({"s": os.urandom(size // 2).hex()}), json.dumps({"s": os.urandom(size // 2).hex()})


def dashboard(size: int) -> tuple[str, str]:
    rng = random.Random(size)
    state = {f"metric_{i:02d}": round(rng.random() * 1000, 3) for i in range(max(4, size // 58))}
    changed = dict(state)
    for key in rng.sample(sorted(state), 3):
        changed[key] = round(rng.random() * 1000, 3)
    return json.dumps(state), json.dumps(changed)


INPUTS: dict[str, Callable[[int], tuple[str, str]]] = {
    "permuted": permuted,
    "shifted": shifted,
    "random": randomized,
    "dashboard": dashboard,
}


def cost(base: str, target: str) -> tuple[float, bool]:
    """CPU seconds of the second publication's frames, and whether it went as a delta."""
    deltas = ChannelDeltas()
    deltas.frames("c", notification_text("c", base, 1, 0), 1)
    text = notification_text("c", target, 2, 0)
    started = time.thread_time()
    built = deltas.frames("c", text, 2)
    return time.thread_time() - started, built.delta is not None


def rows(sizes: list[int], repeat: int) -> Iterator[tuple[str, int, float, bool, float, bool]]:
    bound = wire_deltas.MAX_DELTA_SECONDS
    for name, make in INPUTS.items():
        for size in sizes:
            base, target = make(size)
            results = {}
            for label, seconds in (("bounded", bound), ("unbounded", None)):
                wire_deltas.MAX_DELTA_SECONDS = seconds  # type: ignore[assignment]
                runs = [cost(base, target) for _ in range(repeat)]
                results[label] = (max(r[0] for r in runs), runs[-1][1])
            wire_deltas.MAX_DELTA_SECONDS = bound
            yield name, len(target), *results["bounded"], *results["unbounded"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 16384, 65000])
    args = parser.parse_args()
    print(f"MAX_DELTA_SECONDS = {wire_deltas.MAX_DELTA_SECONDS * 1000:.1f} ms; worst of {args.repeat} runs")
    print(f"{'input':<10} {'bytes':>7} {'bounded ms':>11} {'delta':>6} {'unbounded ms':>13} {'delta':>6} {'ratio':>7}")
    worst = 0.0
    for name, size, bounded, b_delta, unbounded, u_delta in rows(args.sizes, args.repeat):
        worst = max(worst, bounded)
        ratio = unbounded / bounded if bounded else float("inf")
        print(
            f"{name:<10} {size:>7} {bounded * 1000:>11.2f} {'yes' if b_delta else 'no':>6} "
            f"{unbounded * 1000:>13.2f} {'yes' if u_delta else 'no':>6} {ratio:>6.1f}x",
            flush=True,
        )
    print(f"worst bounded: {worst * 1000:.2f} ms of CPU per publication")


if __name__ == "__main__":
    main()
