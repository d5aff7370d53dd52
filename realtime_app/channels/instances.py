"""Which instances of a template exist, and how many live in this process.

``exists(params)`` is the application's answer (a database lookup, usually): it is asked
when a client names an instance this process has not seen lately, never at import, and
kept for a bounded time in a bounded cache. :class:`InstanceBook` counts the live
instances per template — an instance lives while one of its channels (a cadence of it)
has a local subscriber — so that their number stays under the settings' bounds.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from channels.db import database_sync_to_async

from realtime_app.exceptions import RPCError
from realtime_app.wire.protocol import INTERNAL_ERROR

if TYPE_CHECKING:
    from realtime_app.channels.registry import ChannelSpec

__all__ = ["EXISTS_CACHE_SIZE", "EXISTS_NO_S", "EXISTS_YES_S", "InstanceBook", "exists", "forget_exists"]

logger = logging.getLogger("realtime_app.registry")

#: How long an answer of ``exists`` is kept: a "yes" long (a lot rarely disappears; one
#: that does stops being served after this), a "no" short (a lot created while the site
#: runs is served this soon after a client first asked for it).
EXISTS_YES_S = 30.0
EXISTS_NO_S = 2.0
#: Answers kept per process (the least recently asked are forgotten first).
EXISTS_CACHE_SIZE = 10_000

_answers: OrderedDict[tuple[str, str], tuple[float, bool]] = OrderedDict()
_failing: set[str] = set()  # templates whose hook raised last time (logged once)


async def exists(spec: ChannelSpec) -> bool:
    """Whether the instance ``spec`` exists: True for a listed channel and for a template
    without an ``exists`` hook. A hook that raises is an -32603 ``exists_failed`` (logged
    once per failure streak, never cached); a sync hook runs in a worker thread (it may
    query the database)."""
    declared = spec.declared
    if declared is None or declared.exists is None:
        return True
    key = (declared.pattern, spec.base)
    now = time.monotonic()
    cached = _answers.get(key)
    if cached is not None and cached[0] > now:
        _answers.move_to_end(key)
        return cached[1]
    hook = declared.exists
    params = dict(spec.params)
    try:
        if inspect.iscoroutinefunction(hook):
            answer: Any = await hook(params)
        else:
            answer = await database_sync_to_async(hook, thread_sensitive=False)(params)
            if inspect.isawaitable(answer):
                answer = await answer
    except Exception:
        if declared.pattern not in _failing:  # once per failure streak, not per request
            _failing.add(declared.pattern)
            logger.exception("exists hook of %s failed (logged once until it answers again)", declared.pattern)
        raise RPCError(INTERNAL_ERROR, "Internal error", "exists_failed") from None
    _failing.discard(declared.pattern)
    found = bool(answer)
    _answers[key] = (time.monotonic() + (EXISTS_YES_S if found else EXISTS_NO_S), found)
    _answers.move_to_end(key)
    while len(_answers) > EXISTS_CACHE_SIZE:
        _answers.popitem(last=False)
    return found


def forget_exists(pattern: str | None = None) -> None:
    """Forget the kept answers (of one template): after the application created or
    deleted objects and wants it seen at once in this process, and between tests."""
    if pattern is None:
        _answers.clear()
        return
    for key in [k for k in _answers if k[0] == pattern]:
        del _answers[key]


class InstanceBook:
    """Live instances per template in this process: ``template -> base -> channels``.

    An instance (``lot:42``) lives from its first local subscription to any of its
    channels (``lot:42``, ``lot:42:250``) until the last one ends; nothing else keeps it.
    """

    def __init__(self) -> None:
        self.live: dict[str, dict[str, set[str]]] = {}
        self.total = 0

    def refusal(self, template: str, base: str, per_template: int, per_process: int) -> tuple[str, int] | None:
        """Which bound a new instance ``base`` of ``template`` would pass (``("template",
        limit)`` or ``("process", limit)``), or None: an existing instance always fits."""
        bases = self.live.get(template, {})
        if base in bases:
            return None
        if per_template and len(bases) >= per_template:
            return ("template", per_template)
        if per_process and self.total >= per_process:
            return ("process", per_process)
        return None

    def add(self, template: str, base: str, channel: str) -> None:
        bases = self.live.setdefault(template, {})
        channels = bases.get(base)
        if channels is None:
            channels = bases[base] = set()
            self.total += 1
        channels.add(channel)

    def remove(self, template: str, base: str, channel: str) -> None:
        bases = self.live.get(template)
        if bases is None or base not in bases:
            return
        channels = bases[base]
        channels.discard(channel)
        if channels:
            return
        del bases[base]
        self.total -= 1
        if not bases:
            del self.live[template]

    def count(self, template: str) -> int:
        return len(self.live.get(template, {}))
