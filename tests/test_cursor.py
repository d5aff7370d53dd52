"""EventCursor against the vectors the browser module's twin passes too (tests/js/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from realtime_app.wire.cursor import MAX_HELD, EventCursor

CASES = json.loads((Path(__file__).parent / "vectors" / "cursor.json").read_text())["cases"]


def shown(actions: list[tuple[str, Any]]) -> list[list[Any]]:
    return [[kind, value["seq"] if kind == "deliver" else value] for kind, value in actions]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_vectors(case):
    cursor = EventCursor()
    for step in case["steps"]:
        op = step["op"]
        if op == "message":
            params = {"channel": "c", "data": None, "seq": step["seq"], "ts": 0}
            if "epoch" in step:
                params["epoch"] = step["epoch"]
            actions = cursor.message(params)
        elif op == "answer":
            actions = cursor.answer(step["result"])
        elif op == "closed":
            cursor.closed()
            actions = []
        else:
            cursor.resuming()
            actions = []
        assert shown(actions) == step["expect"], step
    assert cursor.since() == case["since_after"]


def test_holding_is_bounded_then_resyncs():
    cursor = EventCursor()
    cursor.answer({"epoch": "a", "seq": 0})
    assert shown(cursor.message({"epoch": "a", "seq": 2})) == [["recover", {"seq": 0, "epoch": "a"}]]
    for seq in range(3, MAX_HELD + 2):
        assert cursor.message({"epoch": "a", "seq": seq}) == []
    actions = cursor.message({"epoch": "a", "seq": MAX_HELD + 2})
    assert shown(actions) == [["resync", {"epoch": "a", "seq": MAX_HELD + 2, "reason": "too_many_held"}]]
    assert shown(cursor.message({"epoch": "a", "seq": MAX_HELD + 3})) == [["deliver", MAX_HELD + 3]]
