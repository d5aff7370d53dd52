"""The process's runtime: one object, :class:`Realtime`, that owns every piece of state the
process keeps between requests — its settings, its hubs (one per event loop), the HTTP
pools, the write-behind stores, the caches and the "said once" book of its logs — so that
nothing lives in a module global and a test (or a reload) starts from one clean object.

Each package keeps its state in a *part*: a small class of its own, made on first use by
:meth:`Realtime.part` with no arguments. The runtime knows no part by name (it sits below
every package that keeps state, beside the settings), so the layers hold: ``hub.core``
asks for its ``Hubs``, ``inbound.pools`` for its ``HttpPools``. A part may define

* ``settings_changed()`` — called when ``REALTIME_APP`` (or ``CHANNEL_LAYERS``) changes;
* ``close()`` and/or ``async aclose()`` — called when the runtime closes.

**The reload rule.** :attr:`Realtime.settings` is built once from ``REALTIME_APP`` over the
defaults and kept. On Django's ``setting_changed`` for ``REALTIME_APP`` (an
``override_settings`` in a test, a settings reload) it is built again and every part is
told; what a part picks up then is said by its ``settings_changed`` (the gates take new
admission, handshake and connection limits at once, the HTTP pools and access rules are
rebuilt at their next use); what a hub built at its start on the settings — its backplane,
key prefix, lease TTL, beat — takes a new hub (a restart).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Hashable
from typing import Any, TypeVar

from realtime_app.conf import apply_json_encoder, get_config
from realtime_app.conf.typed import Settings

__all__ = ["SAID_KEPT", "Realtime", "on_setting_changed", "reset_runtime", "runtime", "settings"]

log = logging.getLogger("realtime_app")

T = TypeVar("T")

#: Keys kept by :meth:`Realtime.first_time` before its book is emptied.
SAID_KEPT = 10_000


class Realtime:
    """What one process keeps: its settings and one instance of each part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # parts are asked for from the loop and from sync views' threads
        self._parts: dict[type[Any], Any] = {}
        self._settings: tuple[dict[str, Any], Settings] | None = None
        self._said: set[Hashable] = set()  # process-wide lines, said once for good
        self._said_of: dict[str, set[Hashable]] = {}  # per family (a user, a method): bounded

    @property
    def settings(self) -> Settings:
        """The settings, typed and frozen, built once (again after ``setting_changed``)."""
        config = get_config()
        built = self._settings
        if built is None or built[0] is not config:
            built = self._settings = (config, Settings.from_config(config))
        return built[1]

    def part(self, kind: type[T]) -> T:
        """This process's one ``kind()``, made on first use."""
        found = self._parts.get(kind)
        if found is None:
            with self._lock:
                found = self._parts.get(kind)
                if found is None:
                    found = self._parts[kind] = kind()
        return found

    def existing(self, kind: type[T]) -> T | None:
        """The part if it was made, without making it (for a probe or a close)."""
        return self._parts.get(kind)

    def parts(self) -> list[Any]:
        return list(self._parts.values())

    def first_time(self, key: Hashable, *, family: str | None = None) -> bool:
        """True the first time ``key`` is asked in this process: a log line said once. With
        ``family`` (one line per user, per method, …) the keys of that family are bounded:
        its book is emptied at :data:`SAID_KEPT`, so such a line may at worst be said
        again; a line without one is said once for good."""
        with self._lock:
            book = self._said if family is None else self._said_of.setdefault(family, set())
            if key in book:
                return False
            if family is not None and len(book) >= SAID_KEPT:
                book.clear()
            book.add(key)
            return True

    def said_again(self, key: Hashable, *, family: str | None = None) -> None:
        """Forget that ``key`` was said (an outage is over: the next one is logged again)."""
        with self._lock:
            (self._said if family is None else self._said_of.get(family, set())).discard(key)

    def settings_changed(self, setting: str) -> None:
        """``REALTIME_APP`` or ``CHANNEL_LAYERS`` changed: the one place a running process
        takes new settings (the rule is this module's docstring)."""
        if setting not in ("REALTIME_APP", "CHANNEL_LAYERS"):
            return
        get_config.cache_clear()
        self._settings = None
        if setting != "REALTIME_APP":  # the channel layer: which backplane a new hub makes
            return
        apply_json_encoder()
        for part in self.parts():
            changed = getattr(part, "settings_changed", None)
            if changed is not None:
                changed()

    async def aclose(self) -> None:
        """Close every part (asynchronous ones awaited), newest first."""
        for part in reversed(self.parts()):
            closing = getattr(part, "aclose", None) or getattr(part, "close", None)
            if closing is None:
                continue
            try:
                result = closing()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("realtime: closing %s failed", type(part).__name__)
        with self._lock:
            self._parts.clear()


_process: list[Realtime] = [Realtime()]  # the one module-level holder: the runtime itself


def runtime() -> Realtime:
    """This process's runtime."""
    return _process[0]


def reset_runtime() -> Realtime:
    """A new, empty runtime for this process (a test's clean start; close the old one first
    with :meth:`Realtime.aclose` when it ran anything)."""
    _process[0] = Realtime()
    return _process[0]


def settings() -> Settings:
    """This process's settings: ``runtime().settings``."""
    return _process[0].settings


def on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    """Django's ``setting_changed`` receiver (connected by the app's ``ready``)."""
    _process[0].settings_changed(setting)
