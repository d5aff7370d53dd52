"""The hub freezes the process's startup heap once (``FREEZE_STARTUP_OBJECTS``): full
collections then walk only what connections made since.

Found: under 1,000 subscribers, the first full collection after the clients connected
walked the whole startup heap (Django, the URL configuration, every module): 0.09 s of
the 0.38 s of CPU each process spent in a 20-second window (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import asyncio, gc, django
django.setup()
from realtime_app.hub.heap import freeze_startup_objects
before = gc.get_freeze_count()
asyncio.run(freeze_startup_objects(None))
once = gc.get_freeze_count()
asyncio.run(freeze_startup_objects(None))  # a second hub of the process
print(before, once, gc.get_freeze_count())
"""


def frozen(overrides: dict[str, object]) -> list[int]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "REALTIME_TEST_OVERRIDES": json.dumps(overrides),
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return [int(n) for n in out.stdout.split()]


@pytest.mark.parametrize("on", [True, False])
def test_the_startup_heap_is_frozen_once_when_asked(on):
    before, once, twice = frozen({"FREEZE_STARTUP_OBJECTS": on})
    assert before == 0
    if on:
        assert once > 10_000 and twice == once  # Django's and the app's objects; not again
    else:
        assert once == twice == 0
