"""Which instances of a template exist, and how many live in this process.

``exists(params)`` is the application's answer (a database lookup, usually): it is asked
when a client names an instance this process has not seen lately, never at import, and
kept for a bounded time in a bounded cache. :class:`InstanceBook` counts the live
instances per template — an instance lives while one of its channels (a cadence of it)
has a local subscriber — so that their number stays under the settings' bounds.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from realtime_app.conf.runtime import runtime
from realtime_app.exceptions import RPCError
from realtime_app.wire.protocol import INTERNAL_ERROR

if TYPE_CHECKING:
    from realtime_app.declarations.registry import ChannelSpec, Declared

__all__ = [
    "EXISTS_CACHE_SIZE",
    "EXISTS_NO_S",
    "EXISTS_YES_S",
    "InstanceBook",
    "exists",
    "forget_exists",
    "sync_in_pool",
]

logger = logging.getLogger("realtime_app.registry")

#: How long an answer of ``exists`` is kept: a "yes" long (a lot rarely disappears; one
#: that does stops being served after this), a "no" short (a lot created while the site
#: runs is served this soon after a client first asked for it).
EXISTS_YES_S = 30.0
EXISTS_NO_S = 2.0
#: Answers kept per process (the least recently asked are forgotten first).
EXISTS_CACHE_SIZE = 10_000

#: A hook that keeps failing is logged at most this often.
EXISTS_LOG_S = 60.0


class ExistsAnswers:
    """What the ``exists`` hooks answered, kept a while (a part of the process's runtime)."""

    def __init__(self) -> None:
        self.answers: OrderedDict[tuple[str, str], tuple[float, bool]] = OrderedDict()
        self.asking: dict[tuple[str, str], asyncio.Task[bool]] = {}  # in flight, shared by their askers
        self.failed_logged: dict[str, float] = {}  # when each template's hook failure was last logged


def _book() -> ExistsAnswers:
    return runtime().part(ExistsAnswers)


async def exists(spec: ChannelSpec, *, ask_again_if_not: bool = False) -> bool:
    """Whether the instance ``spec`` exists: True for a listed channel and for a template
    without an ``exists`` hook. Concurrent askers of one instance share one call of the
    hook. A hook that raises is an -32603 ``exists_failed`` (logged at most once a minute,
    never cached); a sync hook runs in a worker thread (it may query the database).
    ``ask_again_if_not``: a kept "no" is asked again (the publish API: the object may have
    just been made, and a publication refused is lost)."""
    declared = spec.declared
    if declared is None or declared.exists is None:
        return True
    key = (declared.pattern, spec.base)
    now = time.monotonic()
    book = _book()
    cached = book.answers.get(key)
    if cached is not None and cached[0] > now and (cached[1] or not ask_again_if_not):
        book.answers.move_to_end(key)
        return cached[1]
    loop = asyncio.get_running_loop()
    asking = book.asking.get(key)
    if asking is None or asking.get_loop() is not loop:  # one question per instance at a time
        asking = book.asking[key] = loop.create_task(_ask(declared, key, dict(spec.params)))
        asking.add_done_callback(lambda done: _asked(book, key, done))
    return await asyncio.shield(asking)  # a waiter that goes away does not cancel the others'


def _asked(book: ExistsAnswers, key: tuple[str, str], done: asyncio.Task[bool]) -> None:
    if book.asking.get(key) is done:
        del book.asking[key]
    if not done.cancelled():
        done.exception()  # retrieved here: a failure whose askers all went away is no warning


async def sync_in_pool(func: Callable[..., Any], *args: Any) -> Any:
    """``func(*args)`` in a thread of the loop's pool (it may use the ORM), then its
    connections handled as after a request (``django.db.close_old_connections``): closed
    unless ``CONN_MAX_AGE`` keeps them. ``database_sync_to_async`` does the same, but
    through ``channels.db``'s name, which Channels' test communicators replace with a
    no-op — so in a project's tests each pool thread kept a connection open, and a test
    database on PostgreSQL could not be dropped."""

    def run() -> Any:
        from django.db import close_old_connections

        close_old_connections()
        try:
            return func(*args)
        finally:
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()


async def _ask(declared: Declared, key: tuple[str, str], params: dict[str, Any]) -> bool:
    hook = declared.exists
    assert hook is not None
    try:
        if inspect.iscoroutinefunction(hook):
            answer: Any = await hook(params)
        else:
            answer = await sync_in_pool(hook, params)
            if inspect.isawaitable(answer):
                answer = await answer
    except Exception:
        now = time.monotonic()
        logged = _book().failed_logged
        if now - logged.get(declared.pattern, -EXISTS_LOG_S) >= EXISTS_LOG_S:  # not once per request
            logged[declared.pattern] = now
            logger.exception("exists hook of %s failed (logged once a minute while it does)", declared.pattern)
        raise RPCError(INTERNAL_ERROR, "Internal error", "exists_failed") from None
    found = bool(answer)
    answers = _book().answers
    answers[key] = (time.monotonic() + (EXISTS_YES_S if found else EXISTS_NO_S), found)
    answers.move_to_end(key)
    while len(answers) > EXISTS_CACHE_SIZE:
        answers.popitem(last=False)
    return found


def forget_exists(pattern: str | None = None) -> None:
    """Forget the kept answers (of one template): after the application created or
    deleted objects and wants it seen at once in this process, and between tests. A hook
    failing after this is logged at once again."""
    book = _book()
    if pattern is None:
        book.answers.clear()
        book.failed_logged.clear()
        return
    book.failed_logged.pop(pattern, None)
    for key in [k for k in book.answers if k[0] == pattern]:
        del book.answers[key]


class InstanceBook:
    """The channels with local subscribers in this process, counted as the bounds read
    them — never by a walk over all of them on a subscribe: live instances per template
    (``template -> base -> channels``), the cadences running per family base, and the
    channels that hold a lease and run something (a ticker, an app-fed cadence).

    An instance (``lot:42``) lives from its first local subscription to any of its
    channels (``lot:42``, ``lot:42:250``) until the last one ends; nothing else keeps it.
    """

    def __init__(self) -> None:
        self.live: dict[str, dict[str, set[str]]] = {}
        self.total = 0
        self.cadences: dict[str, set[int]] = {}  # family base -> cadences (ms) with subscribers here
        self.tickers = 0  # channels with a ticker or an app-fed cadence, subscribed here

    def opened(self, spec: ChannelSpec) -> None:
        """``spec`` got its first local subscriber."""
        if spec.declared is not None:
            self.add(spec.declared.pattern, spec.base, spec.name)
        if spec.interval_ms is not None:
            self.cadences.setdefault(spec.base, set()).add(spec.interval_ms)
        if spec.has_ticker:
            self.tickers += 1

    def closed(self, spec: ChannelSpec) -> None:
        """``spec`` lost its last local subscriber."""
        if spec.declared is not None:
            self.remove(spec.declared.pattern, spec.base, spec.name)
        running = self.cadences.get(spec.base)
        if spec.interval_ms is not None and running is not None:
            running.discard(spec.interval_ms)
            if not running:
                del self.cadences[spec.base]
        if spec.has_ticker:
            self.tickers -= 1

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
