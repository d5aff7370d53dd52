"""Bytes per update, full frames vs delta frames, on a realistic state feed; and what the
deltas cost: once per publication on the server, once per frame in the client.

The feed: a dashboard state of 40 fields (about 2.3 KB of JSON), three of them changed
per publication, 1,000 publications. Each publication goes through the server's own code
(:class:`realtime_app.wire.deltas.ChannelDeltas`, what the fan-out calls) and a client's
(:mod:`realtime_app.wire.fossil`'s ``apply_delta``); the frames measured are the bytes a
subscriber receives. The CPU ratio per frame divides the delta's cost, paid once per
publication, over the subscribers, against the server's CPU per delivered frame that
``bench/fanout.py`` measures on live daphne (``--frame-us``, 36 µs there: docs/performance.md).
Not yet here: the same on live servers beside permessage-deflate under uvicorn, and the
staleness of a slow client under ``drop`` and ``conflate``.

Usage:  python bench/bandwidth.py [--publications 1000] [--subscribers 100 1000] [--frame-us 36]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realtime_app.wire.deltas import ChannelDeltas
from realtime_app.wire.fossil import apply_delta
from realtime_app.wire.protocol import notification_text


def feed(publications: int, seed: int = 1):
    rng = random.Random(seed)
    state = {f"field_{i}": {"value": round(i * 1.5, 2), "label": f"sensor {i}", "ok": True} for i in range(40)}
    for seq in range(1, publications + 1):
        for k in rng.sample(range(40), 3):
            state[f"field_{k}"]["value"] = round(state[f"field_{k}"]["value"] + rng.uniform(-1, 1), 2)
        yield (
            seq,
            notification_text("dash:board", json.dumps(state, separators=(",", ":")), seq, 1_796_000_000_000 + seq),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--publications", type=int, default=1000)
    parser.add_argument("--subscribers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--frame-us", type=float, default=36.0, help="server CPU per delivered frame (bench/fanout.py)")
    args = parser.parse_args()
    deltas = ChannelDeltas()
    plain, sent, build, apply_cost = [], [], [], []
    base = b""
    for seq, text in feed(args.publications):
        plain.append(len(text.encode()))
        started = time.process_time()
        frames = deltas.frames("dash:board", text, seq)
        build.append(time.process_time() - started)
        if frames.delta is None:
            sent.append(len(frames.full.encode()))
            base = json.loads(frames.full)["params"]["data"].encode()
            continue
        sent.append(len(frames.delta.encode()))
        data = json.loads(frames.delta)["params"]["data"].encode("latin-1")
        started = time.process_time()
        base = apply_delta(base, data)
        apply_cost.append(time.process_time() - started)
        assert json.loads(base) == json.loads(text)["params"]["data"]  # rebuilt exactly
    per_update_plain, per_update_delta = statistics.mean(plain), statistics.mean(sent)
    print(f"{args.publications} publications of a {plain[0] / 1024:.1f} KiB state, 3 of 40 fields changed each")
    print(
        f"bytes per update: plain frames {per_update_plain:.0f} B, delta subscription {per_update_delta:.0f} B "
        f"(fulls included): {per_update_plain / per_update_delta:.1f}x fewer"
    )
    build_us, frame_us = 1e6 * statistics.mean(build), args.frame_us
    print(f"server, once per publication: the delta {build_us:.0f} us (CPU); a delivered frame {frame_us:.0f} us")
    for n in args.subscribers:
        print(f"  {n:>5} subscribers: CPU per frame with deltas / without = {(frame_us + build_us / n) / frame_us:.2f}")
    print(f"client, per delta frame: apply {1e6 * statistics.median(apply_cost):.0f} us (median)")


if __name__ == "__main__":
    main()
