"""Calls that run once: an idempotent method's call with an ``"idempotency_key"`` runs
the first time its caller's identity sends that key, and every repeat within
``IDEMPOTENCY_TTL_S`` — on any connection, on any process — gets the first answer, or
waits for it while it runs (docs/transactions.md).

The book of keys is the backplane's on a cluster (a claim and an answer per key, under
the caller's identity; a claim lives a lease's time and is renewed on each beat while
the call runs, so a process that dies mid-call frees its keys for a retry within a
lease), and this process's own otherwise (one process: nobody else can repeat the key).
Answers are kept bounded: each at most ``IDEMPOTENCY_MAX_ANSWER_BYTES`` (a larger one is
not kept: its repeats are told so), and on one process all of them within
``IDEMPOTENCY_MAX_BYTES``, the oldest forgotten first.

Every answer of a call that ran is its answer, errors included (an internal error may come
after the handler committed: running it again could do the work twice). Only a call that
never started — its key could not be claimed, the backplane being unreachable — leaves the
key free for the retry. A call cut short by the process stopping keeps its claim until its
lease lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from realtime_app.conf import beat_period_s
from realtime_app.conf.typed import Settings
from realtime_app.hub.budgets import ExpiringBytes
from realtime_app.inbound.admission import retry_after_ms
from realtime_app.wire import protocol

if TYPE_CHECKING:
    from realtime_app.cluster.roles import OnceStore

__all__ = ["KEY_PARAM", "MAX_KEY_LENGTH", "Once", "OnceBook"]

logger = logging.getLogger("realtime_app.hub")

#: The by-name param that carries a call's key.
KEY_PARAM = "idempotency_key"
MAX_KEY_LENGTH = 200

Claim = tuple[Literal["run", "running", "answer"], str | None]
Run = Callable[[str, Any], Awaitable[tuple[bool, Any]]]


class OnceBook:
    """One process's book of keys (the memory backplane, and the fallback when the
    backplane keeps none): claims and answers with their expiry, bounded in bytes."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()  # name -> (expires, "r…" | "a…")
        self.bytes = 0

    def _get(self, name: str) -> str | None:
        entry = self._entries.get(name)
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._drop(name)
            return None
        return entry[1]

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.bytes -= len(name) + len(entry[1])

    def _set(self, name: str, value: str, ttl_ms: int) -> None:
        self._drop(name)
        self._entries[name] = (self.clock() + ttl_ms / 1000, value)
        self.bytes += len(name) + len(value)
        if self.bytes > self.max_bytes:  # the oldest answers forgotten first; a running call's claim never
            for old in [n for n, (_, v) in self._entries.items() if v.startswith("a") and n != name]:
                self._drop(old)
                if self.bytes <= self.max_bytes:
                    break

    def claim(self, name: str, owner: str, ttl_ms: int) -> Claim:
        value = self._get(name)
        if value is None:
            self._set(name, "r" + owner, ttl_ms)
            return "run", None
        return ("running", None) if value.startswith("r") else ("answer", value[1:])

    def keep(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        if self._get(name) in (None, "r" + owner):
            self._set(name, "a" + answer, ttl_ms)

    def renew(self, name: str, owner: str, ttl_ms: int) -> None:
        value = self._get(name)
        if value == "r" + owner:
            self._set(name, value, ttl_ms)

    def __len__(self) -> int:
        return len(self._entries)


class Once:
    """Runs idempotent calls once per (identity, method, key): the gate's, one per hub."""

    def __init__(
        self, settings: Settings, backplane: Callable[[], OnceStore | None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.local = OnceBook(settings.idempotency_max_bytes)
        self._backplane = backplane  # the hub's, once it started
        self.clock = clock
        #: The answers kept through this process, soonest to expire first: (expiry, n, identity, bytes).
        self.kept = ExpiringBytes()  # the answers kept through this process, per identity
        self.ran = 0  # first calls run
        self.repeats = 0  # repeats answered with a kept answer
        self.waited = 0  # repeats that waited for a running first call
        self.not_kept = 0  # answers over IDEMPOTENCY_MAX_ANSWER_BYTES
        self.refused_full = 0  # new keys refused: their identity's answers filled its bytes

    @property
    def backplane(self) -> OnceStore | None:
        return self._backplane()

    def _shared(self) -> bool:
        return self.backplane is not None and self.backplane.clustered

    async def _claim(self, name: str, owner: str, ttl_ms: int) -> Claim:
        if self._shared():
            assert self.backplane is not None
            with contextlib.suppress(NotImplementedError):
                return await self.backplane.claim_once(name, owner, ttl_ms)
        return self.local.claim(name, owner, ttl_ms)

    async def _keep(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        if self._shared():
            assert self.backplane is not None
            with contextlib.suppress(NotImplementedError):
                return await self.backplane.keep_once(name, owner, answer, ttl_ms)
        self.local.keep(name, owner, answer, ttl_ms)

    async def _renew(self, name: str, owner: str, ttl_ms: int) -> None:
        if self._shared():
            assert self.backplane is not None
            with contextlib.suppress(NotImplementedError):
                return await self.backplane.renew_once(name, owner, ttl_ms)
        self.local.renew(name, owner, ttl_ms)

    @staticmethod
    def name(identity: tuple[str, str], method: str, key: str) -> str:
        """The book's name of a key: the identity's and method's own (a key of one user
        never answers another's)."""
        digest = hashlib.sha256(f"{identity[0]}\0{identity[1]}\0{method}\0{key}".encode()).hexdigest()[:40]
        return f"once:{digest}"

    async def run(
        self, identity: tuple[str, str], key: Any, execute: Run, method: str, params: Any
    ) -> tuple[bool, Any]:
        """``execute(method, params)`` once for ``key``: ``(ok, result or error)``, the
        first call's on every repeat (``partial(run, identity, key, execute)`` is the
        pool's callback)."""
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
            message = f"Invalid params: '{KEY_PARAM}' must be a string of 1..{MAX_KEY_LENGTH} characters"
            error = protocol.error_response(None, protocol.INVALID_PARAMS, message, "invalid_idempotency_key")
            return False, dict(error["error"])
        name, owner = self.name(identity, method, key), secrets.token_hex(8)
        lease_ms = int(self.settings.lease_ttl_ms)
        delay, waited = 0.02, False
        try:
            while True:
                state, answer = await self._claim(name, owner, lease_ms)
                if state == "run":
                    break
                if state == "answer" and answer is not None:
                    self.repeats += 1
                    self.waited += waited
                    ok, outcome = json.loads(answer)
                    return bool(ok), outcome
                waited = True
                await asyncio.sleep(delay)  # the first call runs: its answer comes, or its claim lapses
                delay = min(delay * 2, 0.5)
        except self._errors() as exc:
            logger.debug("idempotency book unreachable: %s", exc)
            return False, _unavailable()
        full = self._full(identity)
        if full is not None:  # nothing runs: the refusal is kept until it may come back
            self.refused_full += 1
            await self._settle(name, owner, False, full)
            return False, full
        self.ran += 1
        renewing = asyncio.get_running_loop().create_task(self._renewing(name, owner, lease_ms))
        try:
            ok, outcome = await execute(method, params)
        finally:  # cancelled (the process stops): the claim stays until its lease lapses
            renewing.cancel()
        kept = await self._settle(name, owner, ok, outcome)
        self._count(identity, kept)
        return ok, outcome

    def _full(self, identity: tuple[str, str]) -> dict[str, Any] | None:
        """The refusal of a new key of ``identity`` while the answers its calls keep fill
        ``IDEMPOTENCY_MAX_BYTES_PER_IDENTITY`` (until its first one expires), else None."""
        limit = int(self.settings.idempotency_max_bytes_per_identity)
        if not limit or self.kept.of(identity, self.clock()) < limit:
            return None
        first = self.kept.first_expiry(identity)
        retry_ms = max(1, retry_after_ms((first or 0.0) - self.clock()))
        message, reason = "Too many idempotent answers kept", "idempotency_full"
        return dict(
            protocol.error_response(None, protocol.OVERLOADED, message, reason, limit=limit, retry_after_ms=retry_ms)[
                "error"
            ]
        )

    @property
    def kept_bytes(self) -> dict[Any, int]:
        return self.kept.bytes

    def _count(self, identity: tuple[str, str], kept: tuple[int, int] | None) -> None:
        """An answer of ``identity``'s kept: ``(bytes, ttl_ms)``."""
        if kept is not None:
            self.kept.add(identity, kept[0], self.clock() + kept[1] / 1000)

    async def _settle(self, name: str, owner: str, ok: bool, outcome: Any) -> tuple[int, int] | None:
        """Keep the answer, whatever it is, for the repeats — a refusal (-32003..-32005
        with ``retry_after_ms``: nothing was done, come back) only until that time, so the
        retry it asks for runs. What was kept: ``(bytes, ttl_ms)``."""
        ttl_ms = int(self.settings.idempotency_ttl_s) * 1000
        try:
            answer = protocol.encode([ok, outcome])
            if len(answer.encode()) > self.settings.idempotency_max_answer_bytes:
                self.not_kept += 1
                answer = protocol.encode([False, _not_kept()])
            elif not ok and (retry := _retry_after_ms(outcome)) is not None:
                ttl_ms = max(1, min(ttl_ms, retry))
            await self._keep(name, owner, answer, ttl_ms)
        except self._errors() as exc:  # the claim lapses with its lease: a repeat then runs again
            logger.warning("the answer of an idempotent call could not be kept: %s", exc)
            return None
        return len(name) + len(answer.encode()), ttl_ms

    async def _renewing(self, name: str, owner: str, lease_ms: int) -> None:
        while True:
            await asyncio.sleep(beat_period_s(lease_ms))
            with contextlib.suppress(Exception):
                await self._renew(name, owner, lease_ms)

    def _errors(self) -> tuple[type[BaseException], ...]:
        return self.backplane.errors if self.backplane is not None else ()

    def probe(self) -> dict[str, int]:
        return {
            "ran": self.ran,
            "repeats": self.repeats,
            "waited": self.waited,
            "not_kept": self.not_kept,
            "refused_full": self.refused_full,
            "kept_bytes": self.kept.total(self.clock()),
        }


def _retry_after_ms(error: Any) -> int | None:
    """A refusal's ``retry_after_ms`` (an error whose call did nothing), else None."""
    from realtime_app.exceptions import REFUSAL_CODES

    if not isinstance(error, dict) or error.get("code") not in REFUSAL_CODES:
        return None
    data = error.get("data")
    retry = data.get("retry_after_ms") if isinstance(data, dict) else None
    return int(retry) if isinstance(retry, (int, float)) and not isinstance(retry, bool) else None


def _unavailable() -> dict[str, Any]:
    error = protocol.error_response(
        None, protocol.OVERLOADED, "Backplane unavailable", "backplane_unavailable", retry_after_ms=1000
    )["error"]
    return dict(error)


def _not_kept() -> dict[str, Any]:
    message = "The call ran once; its answer was too large to keep for repeats"
    return dict(protocol.error_response(None, protocol.INTERNAL_ERROR, message, "answer_not_kept")["error"])
