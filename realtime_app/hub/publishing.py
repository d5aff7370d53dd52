"""``publish()`` / ``apublish()``: application code puts a message on a channel.

Callable from async code (``apublish``), from sync views, signals and tasks
(``publish``), in a serving process or in any other process of the cluster (a
management command, a worker) — the backplane carries it to every subscribed process.

**On commit.** Inside ``transaction.atomic()`` a publication is checked at once (its
channel, its data) and sent when the outermost transaction of its database (``using``)
commits — never when it rolls back, a savepoint's rollback included: clients never see
what the database did not keep (docs/transactions.md). Outside a transaction it goes at
once. ``now=True`` is the escape hatch for the rare publication that must go whatever
the transaction does (a progress bar of the work inside it).

**Durable channels** (``event_channel(..., durable=True)``): inside a transaction, the
publication is a row of the outbox written in that transaction (:mod:`.outbox`): it goes
out once the transaction committed, through a Redis outage or a process killed meanwhile,
exactly once and in order.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

from asgiref.sync import async_to_sync

from realtime_app.cluster.factory import make_backplane
from realtime_app.cluster.roles import Broker
from realtime_app.declarations.registry import fed_channel, registry
from realtime_app.exceptions import BackplaneUnavailable, ConfigurationError, OutboxFull
from realtime_app.hub.core import Hub
from realtime_app.hub.envelope import encode_publication
from realtime_app.hub.hubs import hub_of_current_loop, running_hub

__all__ = ["acontrol", "apublish", "in_transaction", "publish"]

logger = logging.getLogger("realtime_app.publish")

T = TypeVar("T")


def in_transaction(using: str | None = None) -> bool:
    """True inside ``transaction.atomic()`` on database ``using`` in this thread (read
    without opening a connection: a process that publishes need not use the database)."""
    from django.db import transaction

    return bool(transaction.get_connection(using).in_atomic_block)


def _target(channel: str) -> tuple[str, Any]:
    """Where a publication of ``channel`` goes, and its history: raises what publishing
    it would (an unknown name, a cadence of someone else's)."""
    spec = registry.resolve(channel)
    if spec.fed is not None:
        if spec.name != spec.base:
            raise ConfigurationError(
                f"{channel!r} is a cadence of the app-fed {spec.base!r}: publish the value on {spec.base!r}, "
                "every cadence delivers it"
            )
        return fed_channel(spec.base), spec.fed
    if spec.interval_ms is not None:
        raise ConfigurationError(f"{channel!r} is a cadenced channel: its ticker publishes it, not application code")
    return spec.name, spec.history


def _to_outbox(channel: str, data_json: str, using: str | None) -> None:
    """A durable channel's publication, written to the outbox in the caller's transaction."""
    from django.db import DEFAULT_DB_ALIAS

    from realtime_app.conf.runtime import settings
    from realtime_app.hub.outbox import outbox_refusal, outbox_written
    from realtime_app.persistence import outbox

    alias = using or DEFAULT_DB_ALIAS
    if alias not in settings().outbox_databases:
        raise ConfigurationError(
            f"durable channel {channel!r} published in a transaction of database {alias!r}, whose outbox "
            "nobody drains: add it to REALTIME_APP['OUTBOX_DATABASES']"
        )
    if (refused := outbox_refusal(alias)) is not None:
        raise OutboxFull(channel, *refused)
    outbox.write(channel, data_json, alias)
    outbox_written()


def _after_commit(channel: str, data_json: str) -> None:
    """A publication whose transaction committed: sent now, as it was when published (its
    JSON text, taken then). Its failure cannot undo the commit, so it is logged, never
    raised into the code that committed."""
    try:
        async_to_sync(apublish)(channel, json.loads(data_json))
    except Exception as exc:
        logger.warning("publication on %s after commit not sent: %s", channel, exc)


async def apublish(channel: str, data: Any) -> int:
    """Publish ``data`` on ``channel`` (an event channel, an exact state channel, or the
    base of an app-fed family: its new value, which each cadence delivers at its pace).

    An instance of a template is published by name (``"bids:42"``) and not asked whether
    it exists: application code knows. Returns the publication's ``seq`` (an app-fed
    value's version). Raises :class:`~realtime_app.exceptions.UnknownChannel`
    for a name nobody registered, :class:`ConfigurationError` for a cadenced channel, whose
    frames belong to its ticker or its app-fed base, :class:`~realtime_app.exceptions.PublicationError` for
    data that is not JSON and :class:`~realtime_app.exceptions.PublicationTooLarge` for a
    frame over ``MAX_PUBLICATION_BYTES`` (neither takes a ``seq``), and
    :class:`~realtime_app.exceptions.BackplaneUnavailable` when Redis does not answer.

    Sent at once: async code is never inside a transaction of its own (Django runs them in
    sync code); a transaction's publications are :func:`publish`'s, in that sync code.
    """
    target, history = _target(channel)

    async def headless(backplane: Broker) -> int:
        return await backplane.publish(target, encode_publication(target, data), history=history)

    return await _send(lambda hub: hub.publish(target, data, history), headless, "publish")


def publish(channel: str, data: Any, *, using: str | None = None, now: bool = False) -> int | None:
    """Synchronous :func:`apublish`, for views, signals and tasks (not for async code:
    there, ``await apublish(...)``). Inside ``transaction.atomic()`` on ``using``: checked
    now, sent when the outermost transaction commits, never on rollback (returns None);
    ``now=True`` sends it at once whatever the transaction does."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if not now and in_transaction(using):
            from django.db import transaction

            target, history = _target(channel)
            data_json = encode_publication(target, data)  # refused now, not after the commit
            if history is not None and history.durable:  # a row of this transaction: drained once it commits
                _to_outbox(target, data_json, using)
                return None
            transaction.on_commit(partial(_after_commit, channel, data_json), using=using)
            return None
        return int(async_to_sync(apublish)(channel, data))
    raise RuntimeError(
        f"realtime_app.publish({channel!r}, ...) was called from async code, where it would block the event "
        "loop: use `await realtime_app.apublish(channel, data)` there (publish() is for views, signals, tasks)"
    )


async def acontrol(message: dict[str, Any]) -> None:
    """Send a control message to every serving process (e.g. a logout); internal."""
    from realtime_app.hub.core import CONTROL_CHANNEL
    from realtime_app.wire.protocol import encode

    async def headless(backplane: Broker) -> None:
        await backplane.publish(CONTROL_CHANNEL, encode(message))

    await _send(lambda hub: hub.control(message), headless, "control")


async def _send(
    on_hub: Callable[[Hub], Coroutine[Any, Any, T]], headless: Callable[[Broker], Awaitable[T]], what: str
) -> T:
    """The one way a publication or a control message leaves this process: through the
    running loop's hub, through another thread's hub (on that hub's loop), or — no server
    here (a command, a worker) — through a short-lived backplane; with one process and no
    Redis nobody can be listening there."""
    hub = hub_of_current_loop()
    if hub is not None:
        return await on_hub(hub)
    other = running_hub()
    if other is not None and other.loop is not None:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_hub(other), other.loop))
    backplane = make_backplane()
    try:
        return await headless(backplane)
    except backplane.errors as exc:
        raise BackplaneUnavailable(what, exc) from exc
    finally:
        await backplane.stop()
