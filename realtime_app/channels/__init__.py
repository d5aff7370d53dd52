"""Deprecated alias of :mod:`realtime_app.declarations`, kept for one release.

``from realtime_app.channels.registry import ChannelSpec`` keeps working and warns once;
write ``from realtime_app.declarations.registry import ChannelSpec`` (or import the name
from ``realtime_app``)."""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["SUBMODULES"]

SUBMODULES = ("coverage", "declare", "instances", "policies", "registry", "templates")

warnings.warn(
    "realtime_app.channels is now realtime_app.declarations; the old name goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)


def _alias() -> None:
    for name in SUBMODULES:
        module = importlib.import_module(f"realtime_app.declarations.{name}")
        sys.modules[f"{__name__}.{name}"] = module
        globals()[name] = module


_alias()
