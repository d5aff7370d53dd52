"""The Python client's half of the rules both clients share (tests/vectors/constants.json;
the browser module's half is tests/js/constants.test.mjs)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from realtime_app.client import RESUME_TIMEOUT, RealtimeClient, is_reconnectable_close_code
from realtime_app.exceptions import REFUSAL_CODES
from realtime_app.wire.cursor import MAX_HELD
from realtime_app.wire.history import newer_epoch
from realtime_app.wire.protocol import CloseCode
from realtime_app.wire.retry import RENEWAL_RETRY_REASONS

SHARED = json.loads((Path(__file__).parent / "vectors" / "constants.json").read_text())


def test_close_codes_refusal_codes_and_limits_are_the_shared_ones():
    assert all(is_reconnectable_close_code(code) for code in SHARED["reconnect_close_codes"])
    assert not any(is_reconnectable_close_code(code) for code in SHARED["fatal_close_codes"])
    assert list(REFUSAL_CODES) == SHARED["refusal_codes"]
    assert MAX_HELD == SHARED["max_held"]
    assert RESUME_TIMEOUT * 1000 == SHARED["resume_timeout_ms"]
    assert sorted(RENEWAL_RETRY_REASONS) == SHARED["renewal_retry_reasons"]
    defaults = inspect.signature(RealtimeClient).parameters
    assert defaults["backoff_initial"].default * 1000 == SHARED["backoff_initial_ms"]
    assert defaults["backoff_max"].default * 1000 == SHARED["backoff_max_ms"]


def test_every_close_code_the_server_sends_is_classified():
    shared = set(SHARED["reconnect_close_codes"]) | set(SHARED["fatal_close_codes"])
    assert {int(code) for code in CloseCode} <= shared


@pytest.mark.parametrize(("epoch", "than", "newer"), SHARED["newer_epoch"])
def test_epochs_order_alike(epoch, than, newer):
    assert newer_epoch(epoch, than) is newer
