"""``publish()`` / ``apublish()``: application code puts a message on a channel.

Callable from async code (``apublish``), from sync views, signals and tasks
(``publish``), in a serving process or in any other process of the cluster (a
management command, a worker) — the backplane carries it to every subscribed process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import async_to_sync

from realtime_app.channels.registry import fed_channel, registry
from realtime_app.cluster.factory import make_backplane
from realtime_app.exceptions import BackplaneUnavailable, ConfigurationError
from realtime_app.hub.core import hub_of_current_loop, running_hub
from realtime_app.hub.envelope import encode_publication

__all__ = ["acontrol", "apublish", "publish"]


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
    """
    spec = registry.resolve(channel)
    target, history = spec.name, spec.history
    if spec.fed is not None:
        if spec.name != spec.base:
            raise ConfigurationError(
                f"{channel!r} is a cadence of the app-fed {spec.base!r}: publish the value on {spec.base!r}, "
                "every cadence delivers it"
            )
        target, history = fed_channel(spec.base), spec.fed
    elif spec.interval_ms is not None:
        raise ConfigurationError(f"{channel!r} is a cadenced channel: its ticker publishes it, not application code")
    hub = hub_of_current_loop()
    if hub is not None:
        return await hub.publish(target, data, history)
    other = running_hub()
    if other is not None and other.loop is not None:
        future = asyncio.run_coroutine_threadsafe(other.publish(target, data, history), other.loop)
        return await asyncio.wrap_future(future)
    # No server in this process (a command, a worker): publish through a short-lived
    # backplane; with one process and no Redis nobody can be listening.
    data_json = encode_publication(target, data)
    backplane = make_backplane()
    try:
        return await backplane.publish(target, data_json, history=history)
    except backplane.errors as exc:
        raise BackplaneUnavailable("publish", exc) from exc
    finally:
        await backplane.stop()


def publish(channel: str, data: Any) -> int:
    """Synchronous :func:`apublish`, for views, signals and tasks (not for async code:
    there, ``await apublish(...)``)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return int(async_to_sync(apublish)(channel, data))
    raise RuntimeError(
        f"realtime_app.publish({channel!r}, ...) was called from async code, where it would block the event "
        "loop: use `await realtime_app.apublish(channel, data)` there (publish() is for views, signals, tasks)"
    )


async def acontrol(message: dict[str, Any]) -> None:
    """Send a control message to every serving process (e.g. a logout); internal."""
    from realtime_app.hub.core import CONTROL_CHANNEL
    from realtime_app.wire.protocol import encode

    hub = hub_of_current_loop()
    if hub is not None:
        await hub.control(message)
        return
    other = running_hub()
    if other is not None and other.loop is not None:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(other.control(message), other.loop))
        return
    backplane = make_backplane()
    try:
        await backplane.publish(CONTROL_CHANNEL, encode(message))
    except backplane.errors as exc:
        raise BackplaneUnavailable("control", exc) from exc
    finally:
        await backplane.stop()
