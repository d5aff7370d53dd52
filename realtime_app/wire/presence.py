"""Presence, pure: who is in a channel as one process keeps it, as the cluster merges it,
and the diffs a subscriber applies to rebuild it.

The one implementation of these rules, used by the server's presence room
(:mod:`realtime_app.hub.presence`), the Python client, the browser module's twin and the
tests (a hypothesis machine of join, leave, tab, crash, restart and flush:
``tests/test_presence.py``). No I/O, no clock.

* A **member** is a signed-in user, once per channel however many connections (tabs,
  devices, processes) it has there: ``connections`` counts them, its first join and last
  leave are the events. Anonymous connections are counted (``anonymous``), not listed.
* Each process writes its **part** of a channel (:meth:`LocalRoom.part`); the backplane
  keeps one part per process under that process's lease, and :func:`merge` sums them.
* A subscriber gets a **diff** per interval at most (:func:`diff`): who joined, who left,
  whose connections changed, the count. A member who joined and left within one interval
  appears in neither. Above ``list_up_to`` members a diff carries the count only
  (``listed: false``); when the channel is small again, a ``reset`` with every member.
* Diffs held for a slow subscriber are merged (:func:`compose`), never queued: applying
  the merged diff is applying each in turn (:func:`apply`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EMPTY",
    "PAGE_BYTES",
    "Diff",
    "LocalRoom",
    "Snapshot",
    "apply",
    "compose",
    "diff",
    "members_of",
    "merge",
    "page",
    "parse_part",
    "to_params",
    "view",
]

#: The most JSON one page of members (RPC ``presence``) carries: a few hundred members.
PAGE_BYTES = 16 * 1024

#: user -> (connections, public info or None)
Users = Mapping[str, tuple[int, Any]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A channel's members as the cluster holds them at one moment."""

    users: Users = field(default_factory=dict)
    anonymous: int = 0  # anonymous connections: counted, not listed
    unlisted: int = 0  # members a process counted past its PRESENCE_MAX_MEMBERS, not listed

    @property
    def count(self) -> int:
        return len(self.users) + self.anonymous + self.unlisted


EMPTY = Snapshot()


class LocalRoom:
    """One channel's members on this process, by connection (a connection subscribed to
    two cadences of one family is one connection of the room)."""

    __slots__ = ("anonymous", "conns", "info", "users")

    def __init__(self) -> None:
        self.conns: dict[int, tuple[str | None, int]] = {}  # connection id -> (user, its channels here)
        self.users: dict[str, int] = {}  # user -> connections here
        self.info: dict[str, Any] = {}  # user -> public info
        self.anonymous = 0

    def __bool__(self) -> bool:
        return bool(self.conns)

    def enter(self, conn: int, user: str | None, info: Any = None) -> bool:
        """``conn`` (of ``user``, None: anonymous) is in the room; True when it was not."""
        held = self.conns.get(conn)
        if held is not None:
            self.conns[conn] = (held[0], held[1] + 1)
            return False
        self.conns[conn] = (user, 1)
        if user is None:
            self.anonymous += 1
        else:
            self.users[user] = self.users.get(user, 0) + 1
            if info is not None:
                self.info[user] = info
        return True

    def exit(self, conn: int) -> bool:
        """One of ``conn``'s channels here left; True when the connection left the room."""
        held = self.conns.get(conn)
        if held is None:
            return False
        user, refs = held
        if refs > 1:
            self.conns[conn] = (user, refs - 1)
            return False
        del self.conns[conn]
        if user is None:
            self.anonymous -= 1
        elif self.users[user] > 1:
            self.users[user] -= 1
        else:
            del self.users[user]
            self.info.pop(user, None)
        return True

    def part(self, max_members: int) -> str:
        """This process's part, encoded for the backplane: at most ``max_members`` users
        listed (the first by name), the rest counted."""
        names = sorted(self.users)
        listed = names[:max_members] if max_members else names
        users = {name: [self.users[name], *([self.info[name]] if name in self.info else [])] for name in listed}
        return json.dumps({"u": users, "a": self.anonymous, "x": len(names) - len(listed)}, separators=(",", ":"))


def parse_part(text: str) -> tuple[dict[str, tuple[int, Any]], int, int]:
    """A part as :meth:`LocalRoom.part` wrote it; anything malformed counts as empty."""
    try:
        raw = json.loads(text)
        users = {
            str(name): (int(entry[0]), entry[1] if len(entry) > 1 else None) for name, entry in raw.get("u", {}).items()
        }
        return users, int(raw.get("a", 0)), int(raw.get("x", 0))
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}, 0, 0


def merge(parts: Iterable[str]) -> Snapshot:
    """The cluster's view of a channel: every live process's part, summed."""
    users: dict[str, tuple[int, Any]] = {}
    anonymous = unlisted = 0
    for text in parts:
        part, anon, extra = parse_part(text)
        anonymous += anon
        unlisted += extra
        for name, (connections, info) in part.items():
            held = users.get(name)
            if held is None:
                users[name] = (connections, info)
            else:
                users[name] = (held[0] + connections, held[1] if held[1] is not None else info)
    return Snapshot(users, anonymous, unlisted)


@dataclass(frozen=True, slots=True)
class Diff:
    """What changed between two snapshots, as a subscriber applies it."""

    joined: Users
    left: frozenset[str]
    updated: Users  # members still there whose connections (or info) changed
    count: int
    anonymous: int
    listed: bool = True  # False: too many members, the count only
    reset: Users | None = None  # every member: replaces what the subscriber kept


def diff(before: Snapshot | None, after: Snapshot, listed_before: bool, list_up_to: int) -> Diff | None:
    """What a subscriber that holds ``before`` (listed or not) needs to hold ``after``;
    None when nothing it can see changed."""
    listed = not list_up_to or len(after.users) <= list_up_to
    if not listed:
        if before is None or listed_before or (before.count, before.anonymous) != (after.count, after.anonymous):
            return Diff({}, frozenset(), {}, after.count, after.anonymous, listed=False)
        return None
    if before is None or not listed_before:
        return Diff({}, frozenset(), {}, after.count, after.anonymous, reset=dict(after.users))
    old, new = before.users, after.users
    joined = {name: entry for name, entry in new.items() if name not in old}
    left = frozenset(name for name in old if name not in new)
    updated = {name: entry for name, entry in new.items() if name in old and old[name] != entry}
    if not joined and not left and not updated and (before.count, before.anonymous) == (after.count, after.anonymous):
        return None
    return Diff(joined, left, updated, after.count, after.anonymous)


def compose(first: Diff, then: Diff) -> Diff:
    """One diff with the effect of ``first`` then ``then`` (a slow subscriber's held
    diff and the next one): a member who joined in one and left in the other is in
    neither."""
    if then.reset is not None or not then.listed or not first.listed:
        return then
    if first.reset is not None:
        members = dict(first.reset)
        _apply_users(members, then)
        return Diff({}, frozenset(), {}, then.count, then.anonymous, reset=members)
    joined, left, updated = dict(first.joined), set(first.left), dict(first.updated)
    for name in then.left:
        if name in joined:
            del joined[name]  # joined, then left: never seen
        else:
            updated.pop(name, None)
            left.add(name)
    for name, entry in then.joined.items():
        if name in left:
            left.discard(name)  # left, then back: still there, maybe changed
            updated[name] = entry
        else:
            joined[name] = entry
    for name, entry in then.updated.items():
        (joined if name in joined else updated)[name] = entry
    return Diff(joined, frozenset(left), updated, then.count, then.anonymous)


def _apply_users(members: dict[str, tuple[int, Any]], change: Diff) -> None:
    for name in change.left:
        members.pop(name, None)
    members.update(change.joined)
    members.update(change.updated)


def _member(name: str, entry: tuple[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"user": name, "connections": entry[0]}
    if entry[1] is not None:
        out["info"] = entry[1]
    return out


def to_params(channel: str, change: Diff) -> dict[str, Any]:
    """A ``presence`` notification's params (docs/protocol.md#presence)."""
    params: dict[str, Any] = {
        "channel": channel,
        "count": change.count,
        "anonymous": change.anonymous,
        "joined": [_member(n, e) for n, e in sorted(change.joined.items())],
        "left": sorted(change.left),
        "updated": [_member(n, e) for n, e in sorted(change.updated.items())],
    }
    if not change.listed:
        params["listed"] = False
    if change.reset is not None:
        params["reset"] = True
        params["members"] = [_member(n, e) for n, e in sorted(change.reset.items())]
    return params


def view(snapshot: Snapshot, list_up_to: int) -> dict[str, Any]:
    """What a new presence subscriber starts from (its subscribe's ``presence``)."""
    listed = not list_up_to or len(snapshot.users) <= list_up_to
    out: dict[str, Any] = {"count": snapshot.count, "anonymous": snapshot.anonymous, "listed": listed}
    out["members"] = [_member(n, e) for n, e in sorted(snapshot.users.items())] if listed else []
    return out


def members_of(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The member set (user -> member) a ``members`` list gives: a subscribe's
    ``presence``, a ``presence`` reply, a reset."""
    return {m["user"]: dict(m) for m in params.get("members", ()) if isinstance(m, dict) and m.get("user") is not None}


def apply(members: dict[str, dict[str, Any]], params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``members`` after one ``presence`` notification, as a new dict (empty while the
    channel is too large to be listed)."""
    if params.get("reset") or params.get("listed") is False:
        return members_of(params)
    out = dict(members)
    for name in params.get("left", ()):
        out.pop(name, None)
    for member in [*params.get("joined", ()), *params.get("updated", ())]:
        if isinstance(member, dict) and member.get("user") is not None:
            out[member["user"]] = dict(member)
    return out


def page(
    snapshot: Snapshot, after: str | None, max_bytes: int, list_anonymous: bool = False
) -> tuple[list[dict[str, Any]], bool]:
    """The members after ``after`` (by name), at most ``max_bytes`` of JSON but at least
    one, and whether more follow (``truncated``). Anonymous connections, when listed, are
    one last ``{"user": null}`` entry."""
    out: list[dict[str, Any]] = []
    size = 2  # the list's brackets; each member adds its JSON and a separator
    names = sorted(n for n in snapshot.users if after is None or n > after)
    for name in names:
        member = _member(name, snapshot.users[name])
        size += len(json.dumps(member, ensure_ascii=False).encode("utf-8")) + 2
        if out and size > max_bytes:
            return out, True
        out.append(member)
    if list_anonymous and snapshot.anonymous:
        out.append({"user": None, "connections": snapshot.anonymous})
    return out, False
