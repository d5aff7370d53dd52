"""The cluster membership of one process as a pure state machine (no asyncio, no Redis).

For every channel the process keeps the *desired* state — it has local subscribers, the
channel has a ticker — next to what it *believes* the backplane holds: it is in the
channel's group, it holds the ticker's lease, the ticker runs here. Events come in
(local subscribe and unsubscribe, the result of each action, another process released a
lease, a maintenance beat, the backplane lost its state); :meth:`Reconciler.next_action`
says what to do next to bring belief and desire together. The hub only carries the
actions out, one at a time per channel, and reports each result with :meth:`done`.

It is level-triggered, not edge-triggered (docs/reliability.md): nothing on the
backplane is assumed to stay. Every beat asks again for what a live member must keep
(renew the lease, compete for a free one, retry what failed), and a *re-assert* — at a
beat after the backplane lost its state, or periodically, well within channels-redis'
``group_expiry`` — joins every wanted group again, so any lost membership heals within
one period.

Order of actions for a channel, first applicable wins: stop a ticker that should not
run; release a lease that is not wanted; join a wanted group; acquire a wanted lease;
start a ticker whose lease is held; leave an unwanted group; renew a held lease. Hence
a ticker runs only while the lease is held and the channel has local subscribers.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Action", "ChannelState", "Reconciler"]


class Action(enum.Enum):
    """What the hub does for one channel."""

    JOIN = "join"  # add this process to the channel's backplane group
    LEAVE = "leave"  # remove it
    ACQUIRE = "acquire"  # try to take the ticker's lease (granted or not)
    RENEW = "renew"  # keep the lease (False: it was lost)
    RELEASE = "release"  # give the lease up and tell the other processes
    START = "start"  # call the channel's factory here
    STOP = "stop"  # call its cleanup


#: Actions that talk to the backplane (they can fail because it is unreachable).
REMOTE = frozenset({Action.JOIN, Action.LEAVE, Action.ACQUIRE, Action.RENEW, Action.RELEASE})


@dataclass(slots=True)
class ChannelState:
    """Desired and believed state of one channel in this process."""

    wanted: bool = False  # the process has local subscribers
    ticker: bool = False  # the channel has a factory (a ticker to elect)
    joined: bool = False  # believed to be in the channel's group
    held: bool = False  # believed to hold the ticker's lease
    running: bool = False  # the ticker runs here
    rejoin: bool = False  # a re-assert asks to join again even if believed joined
    acquire_due: bool = False  # compete for the lease at the next step
    renew_due: bool = False  # renew the lease at the next step
    backoff: bool = False  # the factory failed: release the lease, retry at the next beat
    parked: bool = False  # a remote action failed: wait for the next beat
    yielding: bool = False  # a draining process gives the lease up now (:meth:`Reconciler.yield_leases`)
    yielded: bool = False  # ... and lets one beat go by before it competes again
    lease_at: float = float("-inf")  # when the lease was last granted or renewed (monotonic)

    @property
    def idle(self) -> bool:
        """Nothing wanted, nothing held: the record can be forgotten."""
        return not (self.wanted or self.joined or self.held or self.running)

    @property
    def quiet(self) -> bool:
        """Joined as wanted, no ticker, nothing due or failed: no action, and a beat that
        does not re-assert changes nothing (most channels, most of the time)."""
        return (
            self.wanted
            and self.joined
            and not (self.ticker or self.held or self.running or self.rejoin or self.acquire_due or self.renew_due)
            and not (self.backoff or self.parked or self.yielding or self.yielded)
        )


class Reconciler:
    """Per-process desired vs believed state of every channel; says what to do next."""

    def __init__(self) -> None:
        self.channels: dict[str, ChannelState] = {}
        #: The channels that are not :attr:`ChannelState.quiet`: what a beat and
        #: :meth:`pending` look at (an idle channel costs nothing per beat).
        self.active: dict[str, None] = {}  # in the order they became active

    def _state(self, channel: str) -> ChannelState:
        state = self.channels.get(channel)
        if state is None:
            state = self.channels[channel] = ChannelState()
        return state

    def _forget_if_idle(self, channel: str) -> None:
        """File the channel after an event: forgotten when idle, active unless quiet."""
        state = self.channels.get(channel)
        if state is not None and state.idle:
            del self.channels[channel]
            state = None
        if state is None or state.quiet:
            self.active.pop(channel, None)
        else:
            self.active[channel] = None

    # -- events -------------------------------------------------------------------

    def subscribed(self, channel: str, *, ticker: bool) -> None:
        """The channel got its first local subscriber."""
        state = self._state(channel)
        state.wanted, state.ticker = True, ticker
        state.acquire_due = ticker and not state.held
        self._forget_if_idle(channel)

    def unsubscribed(self, channel: str) -> None:
        """The channel's last local subscriber left."""
        state = self.channels.get(channel)
        if state is not None:
            state.wanted = False
            state.rejoin = state.acquire_due = False
            self._forget_if_idle(channel)

    def released_elsewhere(self, channel: str) -> None:
        """Another process gave the lease up: compete for it now, not at the next beat."""
        state = self.channels.get(channel)
        if state is not None and state.wanted and state.ticker and not state.held:
            state.acquire_due = True
            self.active[channel] = None

    def yield_leases(self) -> list[str]:
        """The process drains: stop every ticker and release its lease now, so that another
        process with subscribers takes it at once (told by the release), not after a lease
        timeout. This process competes again from the second beat on: a channel nobody
        else serves gets its ticker back here. Returns the channels to converge."""
        held = [name for name in list(self.active) if self.channels[name].held or self.channels[name].acquire_due]
        for name in held:  # a lease being acquired now is released as soon as it is granted
            self.channels[name].yielding = True
        return held

    def beat(self, *, reassert: bool = False) -> None:
        """The maintenance beat: renew, compete, retry; ``reassert`` re-joins every group.

        Pass ``reassert=True`` after the backplane lost (or may have lost) its state, and
        periodically within ``group_expiry``.
        """
        for name in list(self.channels if reassert else self.active):  # a quiet one: nothing changes
            state = self.channels[name]
            if state.yielding and not state.held:  # nothing was granted since the drain began
                state.yielding, state.yielded = False, True
            state.parked = False
            state.renew_due = state.held
            state.acquire_due = state.wanted and state.ticker and not state.held and not state.yielded
            state.yielded = False
            state.backoff = False
            if reassert and state.wanted:
                state.rejoin = True
            self._forget_if_idle(name)

    # -- decisions ----------------------------------------------------------------

    def next_action(self, channel: str) -> Action | None:
        """The next action that brings ``channel`` closer to its desired state, or None."""
        state = self.channels.get(channel)
        if state is None:
            return None
        keep_ticker = state.wanted and state.ticker and not state.yielding
        if state.running and not (keep_ticker and state.held):
            return Action.STOP
        if state.parked:
            return None
        if state.held and (not keep_ticker or state.backoff):
            return Action.RELEASE
        if state.wanted and (not state.joined or state.rejoin):
            return Action.JOIN
        if keep_ticker and not state.held and state.acquire_due and not state.backoff:
            return Action.ACQUIRE
        if keep_ticker and state.held and not state.running:
            return Action.START
        if state.joined and not state.wanted:
            return Action.LEAVE
        if state.held and state.renew_due:
            return Action.RENEW
        return None

    def pending(self) -> Iterator[str]:
        """Channels with an action to carry out now (a snapshot: safe to act while iterating)."""
        return iter([name for name in self.active if self.next_action(name) is not None])

    def lease_fresh(self, channel: str, now: float, ttl_s: float) -> bool:
        """True while this process may publish for ``channel``'s ticker: the lease was
        granted or renewed less than ``ttl_s`` before ``now``. A process cut off from the
        backplane stops publishing before another one can take the lease over."""
        state = self.channels.get(channel)
        return state is not None and state.held and now - state.lease_at < ttl_s

    def running(self) -> list[str]:
        """The channels whose ticker runs in this process (the one record of it)."""
        return sorted(name for name, state in self.channels.items() if state.running)

    def done(self, channel: str, action: Action, ok: bool, now: float | None = None) -> None:
        """Report the result of ``action``.

        ``ok`` is the outcome: for ACQUIRE whether the lease was granted, for RENEW
        whether it is still held, for START whether the factory succeeded; for the other
        remote actions whether the backplane answered. Use :meth:`failed` when a remote
        action raised (the backplane is unreachable). ``now`` dates a granted or renewed
        lease (:meth:`lease_fresh`).
        """
        state = self.channels.get(channel)
        if state is None:
            return
        if action is Action.JOIN:
            state.joined = ok or state.joined
            state.rejoin = state.rejoin and not ok
        elif action is Action.LEAVE:
            state.joined = state.joined and not ok
        elif action in (Action.ACQUIRE, Action.RENEW):
            state.held = ok
            state.acquire_due = state.renew_due = False
            state.lease_at = now if ok and now is not None else float("-inf")
        elif action is Action.RELEASE:
            state.yielded = state.yielding
            state.held = state.yielding = False  # released, or it expires on its own
        elif action is Action.START:
            state.running = ok
            state.backoff = not ok  # let another process try; retry at the next beat
        elif action is Action.STOP:
            state.running = False
        if not state.held and not state.acquire_due:
            state.yielding = False  # nothing left to give up (lost, refused, or released)
        self._forget_if_idle(channel)

    def failed(self, channel: str, action: Action) -> None:
        """A remote action raised: keep what is believed and wait for the next beat."""
        state = self.channels.get(channel)
        if state is None:
            return
        state.parked = True
        if action is Action.RELEASE:
            state.yielded = state.yielding
            state.held = state.yielding = False  # the lease expires on its own
        elif action is Action.RENEW:
            state.renew_due = False  # believed held until the backplane answers
        elif action is Action.ACQUIRE:
            state.acquire_due = False
        if not state.held and not state.acquire_due:
            state.yielding = False
        self._forget_if_idle(channel)
