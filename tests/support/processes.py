"""The servers' processes seen from outside."""

from __future__ import annotations

from typing import Any

import psutil

__all__ = ["rss"]


def rss(server: Any) -> int:
    """Resident memory of a started server's process, in bytes."""
    assert server.process is not None
    return int(psutil.Process(server.process.pid).memory_info().rss)
