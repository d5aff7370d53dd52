"""The built-in methods every connection may call: ``subscribe``, ``unsubscribe``, ``ping``,
``publish`` and ``presence`` (docs/protocol.md). Each checks its params, the channel's rules and its
bounds, then asks the hub; the consumer only routes to them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from channels.db import database_sync_to_async
from django.db import DatabaseError

from realtime_app.conf.runtime import settings
from realtime_app.declarations.policies import Action, allowed
from realtime_app.declarations.registry import ChannelSpec, registry
from realtime_app.endpoint.sessions import needs_user
from realtime_app.endpoint.subscribing import bounded, require_existing
from realtime_app.endpoint.tokens import TOKEN, Claims, TokenError, arm_expiry, granted, token_user, verify
from realtime_app.exceptions import NO_USER_HINT, ForbiddenChannel, PublicationError, PublicationTooLarge, RPCError
from realtime_app.hub.core import Connection, Hub
from realtime_app.hub.hubs import get_hub
from realtime_app.hub.presence import member_of
from realtime_app.wire import protocol
from realtime_app.wire.asgi import Scope
from realtime_app.wire.deltas import FOSSIL
from realtime_app.wire.history import Since
from realtime_app.wire.presence import PAGE_BYTES, page
from realtime_app.wire.session import ServerSession

__all__ = ["BUILTINS", "Caller", "require"]


class Caller(Protocol):
    """What a built-in reads of the connection that calls it (``RealtimeConsumer``)."""

    scope: Scope
    connection: Connection | None
    session: ServerSession[ChannelSpec] | None

    @property
    def user(self) -> Any: ...
    async def current_user(self) -> Any: ...
    def signed_in(self, user: Any) -> None: ...


Builtin = Callable[[Caller, Any], Awaitable[Any]]


def _invalid(message: str, reason: str, **data: Any) -> RPCError:
    return RPCError(protocol.INVALID_PARAMS, message, reason, **data)


def channel_param(params: Any) -> str:
    """``params["channel"]`` (or ``params[0]``): a non-empty name within ``MAX_CHANNEL_NAME``."""
    if isinstance(params, dict):
        channel = params.get("channel")
    elif isinstance(params, list) and len(params) >= 1:
        channel = params[0]
    else:
        raise _invalid('Invalid params: expected {"channel": name}', "missing_channel")
    if not isinstance(channel, str) or not channel:
        raise _invalid("Invalid params: 'channel' must be a non-empty string", "invalid_channel")
    limit = settings().max_channel_name
    if len(channel) > limit:
        raise _invalid(
            f"Invalid params: channel name over {limit} characters", "channel_name_too_long", max_length=limit
        )
    return channel


def since_param(params: Any) -> Since | None:
    """``params["since"]``: where a client resumes a channel with history, or None."""
    if not isinstance(params, dict) or params.get("since") is None:
        return None
    try:
        return Since.parse(params["since"])
    except ValueError as exc:
        raise _invalid(f"Invalid params: {exc}", "invalid_since") from None


async def require(consumer: Caller, spec: ChannelSpec, action: Action) -> None:
    """Refuse unless the user may ``action`` the channel — the user as its session and
    the database say now, for a guarded channel (logout, deactivation, demotion). A
    channel its connection token grants is the token holder's to subscribe, no query."""
    if action == "subscribe" and granted(consumer.scope, spec):
        if getattr(await consumer.current_user(), "is_authenticated", False):  # its user still holds
            return
        raise ForbiddenChannel(spec.name, action)
    family = registry.family_of(spec.name)
    user = await consumer.current_user() if needs_user(spec.name, action) else consumer.user
    if not await allowed(user, spec.name, family.base if family else None, action):
        raise ForbiddenChannel(spec.name, action, None if "user" in consumer.scope else NO_USER_HINT)


async def subscribe(consumer: Caller, params: Any) -> dict[str, Any]:
    spec = registry.resolve(channel_param(params))
    await require(consumer, spec, "subscribe")
    await require_existing(spec)
    conn = consumer.connection
    assert conn is not None and consumer.session is not None
    config = settings()
    limit = config.max_subscriptions
    if limit and spec.name not in conn.subscriptions and len(conn.subscriptions) >= limit:
        raise RPCError(protocol.TOO_MANY_SUBSCRIPTIONS, "Too many subscriptions", "too_many_subscriptions", limit=limit)
    since = since_param(params)
    delta = params.get("delta") if isinstance(params, dict) else None
    if delta is not None and delta != FOSSIL:
        raise _invalid(f'Invalid params: "delta" must be "{FOSSIL}"', "invalid_delta")
    watch = await presence_param(consumer, spec, params)
    hub = await get_hub()
    if spec.name not in hub.subscribers:
        anonymous = conn.owner is not None and conn.owner[0] != "user"
        spec = await bounded(hub, spec, config, partial(require, consumer, action="subscribe"), anonymous)
    answer: dict[str, Any] = {"channel": spec.name, "kind": spec.kind, "interval_ms": spec.interval_ms}
    if spec.presence and conn.member is None:  # who it is in presence channels, asked once
        conn.member = await database_sync_to_async(member_of)(consumer.user)
    if spec.history is not None:  # a resume replays full frames, then deltas go on
        answer.update(await hub.subscribe_kept(conn, spec, since, deltas=delta is not None))
        return await _watched(hub, conn, spec, watch, answer)
    await hub.subscribe(conn, spec)
    consumer.session.follow_answer(spec)  # a state channel's value now, not a period later
    if delta is not None:  # granted: a full frame first (also on a subscribe again); never on a conflated channel
        answer["delta"] = FOSSIL if hub.fanout.want_deltas(conn, spec.name) else False
    if since is not None:  # nothing kept to resume from: the application resyncs
        answer.update(recovered=False, reason="no_history")
    return await _watched(hub, conn, spec, watch, answer)


async def presence_param(consumer: Caller, spec: ChannelSpec, params: Any) -> bool:
    """``params["presence"]``: True when the subscriber asks for the channel's presence
    diffs (a presence channel, and the ``presence`` rule allows it)."""
    watch = params.get("presence", False) if isinstance(params, dict) else False
    if not isinstance(watch, bool):
        raise _invalid('Invalid params: "presence" must be true or false', "invalid_presence")
    if watch and not spec.presence:
        raise _invalid(f"Invalid params: {spec.name} is not a presence channel", "no_presence")
    if watch:
        await require(consumer, spec, "presence")
    return watch


async def _watched(
    hub: Hub, conn: Connection, spec: ChannelSpec, watch: bool, answer: dict[str, Any]
) -> dict[str, Any]:
    """The subscriber watches presence: its first ``presence`` frame (every member) goes
    before this answer, the diffs after it."""
    if watch and spec.name in conn.subscriptions:
        await hub.presence.watch(conn, spec)
        answer["presence"] = True
    return answer


async def auth(consumer: Caller, params: Any) -> dict[str, Any]:
    """Sign the connection in with a connection token (docs/auth.md): its first request,
    or a refresh — a newer token of the same user — at any time."""
    token = params.get("token") if isinstance(params, dict) else None
    if not isinstance(token, str) or not token:
        raise _invalid('Invalid params: expected {"token": string}', "missing_token")
    try:
        claims = verify(token)
        user = await database_sync_to_async(token_user)(claims)
    except TokenError as error:
        raise RPCError(protocol.FORBIDDEN_CHANNEL, f"Token {error.reason}", f"token_{error.reason}") from None
    except DatabaseError:  # an outage: the token may be good, ask again (it was -32603 and a traceback)
        raise RPCError(
            protocol.OVERLOADED, "Database unavailable", "database_unavailable", retry_after_ms=1000
        ) from None
    held: Claims | None = consumer.scope.get(TOKEN)
    current = consumer.user if getattr(consumer.user, "is_authenticated", False) else None
    conn, hub = consumer.connection, await get_hub()
    if conn is None or conn.closed or conn not in hub.connections:
        raise RPCError(protocol.INVALID_REQUEST, "The connection is closing", "closing")
    if held is None and (consumer.session is None or consumer.session.requests != 1 or conn.subscriptions):
        raise RPCError(protocol.INVALID_REQUEST, "auth must be the connection's first request", "auth_not_first")
    if current is not None and str(current.pk) != claims.user:
        raise RPCError(protocol.FORBIDDEN_CHANNEL, "A token of another user", "another_user")
    if current is None:  # anonymous until now: the user's connection from now on (its cap, its bucket)
        refused = hub.gate.enter(("user", claims.user))  # the new identity first: refused, the old one stays
        if refused is not None:
            raise RPCError(protocol.OVERLOADED, "Too many connections", "too_many_connections", retry_after_ms=5000)
        if conn.identity is not None:
            hub.gate.leave(conn.identity)
        conn.identity, conn.member = ("user", claims.user), None
    consumer.scope.pop("session", None)  # the token's user, not a cookie's
    consumer.scope[TOKEN] = claims
    consumer.signed_in(user)
    arm_expiry(hub, conn, consumer.scope)
    return {"user": user.get_username(), "expires_at": claims.expires_at}


async def presence(consumer: Caller, params: Any) -> dict[str, Any]:
    """Who is in a presence channel: the count and a page of members by name, at most
    ``PAGE_BYTES`` of them (``truncated``: the next page is ``after`` the last name)."""
    spec = registry.resolve(channel_param(params))
    if not spec.presence:
        raise _invalid(f"Invalid params: {spec.name} is not a presence channel", "no_presence")
    after = params.get("after") if isinstance(params, dict) else None
    if after is not None and not isinstance(after, str):
        raise _invalid('Invalid params: "after" must be a user name', "invalid_after")
    await require(consumer, spec, "presence")
    await require_existing(spec)
    hub = await get_hub()
    snapshot = await hub.presence.read(spec)
    members, truncated = page(snapshot, after, PAGE_BYTES, bool(settings().presence_list_anonymous))
    return {
        "channel": spec.name,
        "count": snapshot.count,
        "anonymous": snapshot.anonymous,
        "members": members,
        "truncated": truncated,
    }


async def unsubscribe(consumer: Caller, params: Any) -> dict[str, Any]:
    spec = registry.resolve(channel_param(params))
    assert consumer.connection is not None
    hub = await get_hub()
    was = await hub.unsubscribe(consumer.connection, spec.name)
    return {"channel": spec.name, "unsubscribed": was}


async def ping(consumer: Caller, params: Any) -> str:
    return "pong"


async def publish(consumer: Caller, params: Any) -> dict[str, Any]:
    from realtime_app.hub.publishing import apublish

    name = channel_param(params)
    if not isinstance(params, dict) or "data" not in params:
        raise _invalid('Invalid params: expected {"channel": name, "data": ...}', "missing_data")
    spec = registry.resolve(name)
    if spec.kind != "event":
        raise ForbiddenChannel(spec.name, "publish")
    await require(consumer, spec, "publish")
    await require_existing(spec)
    try:
        seq = await apublish(spec.name, params["data"])
    except PublicationTooLarge as exc:
        raise _invalid(f"Invalid params: {exc}", "publication_too_large", limit=exc.limit) from None
    except PublicationError as exc:
        raise _invalid(f"Invalid params: {exc.problem}", "invalid_data") from None
    return {"channel": spec.name, "seq": seq}


#: The built-in methods by name (their costs: ``endpoint.methods.BUILTIN_COSTS``).
BUILTINS: dict[str, Builtin] = {
    "subscribe": subscribe,
    "unsubscribe": unsubscribe,
    "ping": ping,
    "publish": publish,
    "presence": presence,
    "auth": auth,
}
