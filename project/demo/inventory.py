"""The demo's per-user inventory and its RPC methods (SPEC §10): admission, coalescing
and write-behind persistence.

``inventory.consume`` is the cheap, frequent kind of call admission is built for (shots
fired): cost 0.25. As on a game server, a player's inventory changes one operation at a
time, each applied at the world's next step (``STEP_S``): the requests of one user for
one item that come while one runs wait, and merge into one execution of up to 250 shots
(``Coalesce(serial=True)``). A user's inventory is a
:class:`~realtime_app.WriteBehindStore` over :class:`~project.demo.models.InventoryItem`:
a shot is **accepted** in memory at once and **durable** after the next flush (``shots``
is a counter: two processes of one user both land). A new user starts with 10,000 shots of
``"ammo"``; an anonymous connection gets its own inventory, never persisted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from typing import Any

import realtime_app
from realtime_app import RPCError
from realtime_app.persistence.write_behind import WriteBehindStore

from .models import InventoryItem

START = {"ammo": 10_000}
MAX_SHOTS = 250
STEP_S = 0.05  # the world's step: an inventory operation is applied at the next one
MAX_SLEEP_MS = 5000
OUT_OF_STOCK = -32010  # an application error code (-32010..-32099 are the applications': docs/methods.md)

store: WriteBehindStore[InventoryItem] = WriteBehindStore(
    InventoryItem,
    key=("user_id", "item"),
    fields=("shots",),
    counters=("shots",),
    defaults=lambda key: {"shots": START.get(key[1], 0)},
    name="demo.inventory",
)


class OutOfStock(RPCError):
    def __init__(self, item: str, left: int) -> None:
        super().__init__(OUT_OF_STOCK, "Out of stock", "out_of_stock", item=item, shots_left=left)


def _anonymous(consumer: Any) -> dict[str, int]:
    inventory: dict[str, int] | None = getattr(consumer, "demo_inventory", None)
    if inventory is None:
        inventory = consumer.demo_inventory = dict(START)
    return inventory


def _user_pk(consumer: Any) -> int | None:
    kind, who = consumer.admission_identity()
    return int(who) if kind == "user" else None


async def snapshot(consumer: Any) -> dict[str, Any]:
    """What the client shows and resyncs to: ``items`` accepted in memory, ``durable`` as
    the database holds them (as this process last read or wrote them), and how long ago
    they were saved; ``user``: whose (None: an anonymous client's)."""
    pk = _user_pk(consumer)
    if pk is None:
        return {"user": None, "items": dict(_anonymous(consumer)), "durable": {}, "unsaved": False, "saved_ago_s": None}
    items: dict[str, int] = {}
    durable: dict[str, int] = {}
    saved: list[float] = []
    for item in START:
        state = await store.get((pk, item))
        if state is not None:
            items[item] = state["shots"]
        row, saved_at = store.durable((pk, item))
        if row is not None:
            durable[item] = row["shots"]
        if saved_at is not None:
            saved.append(saved_at)
    unsaved = any(store.unsaved((pk, item)) for item in START)
    ago = round(time.time() - max(saved), 1) if saved else None
    user = consumer.user.get_username()
    return {"user": user, "items": items, "durable": durable, "unsaved": unsaved, "saved_ago_s": ago}


def _invalid(message: str, reason: str, **data: Any) -> RPCError:
    return RPCError(-32602, f"Invalid params: {message}", reason, **data)


def _consume_params(params: Any) -> tuple[str, int]:
    if not isinstance(params, dict):
        raise _invalid('expected {"item": str, "shots": int}', "invalid_params")
    item, shots = params.get("item"), params.get("shots")
    if not isinstance(item, str) or not 0 < len(item) <= 64:
        raise _invalid("'item' must be a string of 1..64 characters", "invalid_item")
    if isinstance(shots, bool) or not isinstance(shots, int) or not 1 <= shots <= MAX_SHOTS:
        raise _invalid(f"'shots' must be an int 1..{MAX_SHOTS}", "invalid_shots", max=MAX_SHOTS)
    return item, shots


def _key(identity: Hashable, params: Any) -> Hashable | None:
    try:
        item, _ = _consume_params(params)
    except RPCError:
        return None  # runs alone, and its handler says what is wrong
    return (identity, item)


def _merge(all_params: list[Any]) -> dict[str, Any]:
    return {"item": all_params[0]["item"], "shots": sum(p["shots"] for p in all_params)}


def _answer(result: dict[str, Any], params: Any, units: float, requests: int) -> dict[str, Any]:
    return {**result, "shots": int(units), "merged": requests}


@realtime_app.rpc_method(
    "inventory.consume",
    cost=0.25,
    coalesce=realtime_app.Coalesce(
        key=_key, units=lambda params: params["shots"], merge=_merge, cap=MAX_SHOTS, answer=_answer, serial=True
    ),
    snapshot=snapshot,
)
async def consume(consumer: Any, params: Any) -> dict[str, Any]:
    """Fire ``shots`` of ``item``: ``{"item", "shots_left", "shots", "merged"}``."""
    item, shots = _consume_params(params)  # merged params too: a job never exceeds the cap
    await asyncio.sleep(STEP_S)  # applied at the world's next step
    pk = _user_pk(consumer)
    if pk is None:
        inventory = _anonymous(consumer)
        left = inventory.get(item, 0)
        if shots > left:
            raise OutOfStock(item, left)
        inventory[item] = left - shots
        return {"item": item, "shots_left": left - shots, "shots": shots, "merged": 1}

    def fire(state: dict[str, Any]) -> None:
        if shots > state["shots"]:
            raise OutOfStock(item, state["shots"])
        state["shots"] -= shots

    accepted = await store.mutate((pk, item), fire)  # accepted now, durable after the next flush
    assert accepted.state is not None
    return {"item": item, "shots_left": accepted.state["shots"], "shots": shots, "merged": 1}


@realtime_app.rpc_method("inventory.snapshot", cost=0.25, snapshot=snapshot)
async def inventory_snapshot(consumer: Any, params: Any) -> dict[str, Any]:
    """``{"user", "items": {item: shots_left}, "durable": {item: shots_left}, "unsaved", "saved_ago_s"}``."""
    return await snapshot(consumer)


@realtime_app.rpc_method("demo.echo")
async def echo(consumer: Any, params: Any) -> dict[str, str]:
    """``{"text": str}`` back."""
    if not isinstance(params, dict) or not isinstance(params.get("text"), str):
        raise _invalid('expected {"text": str}', "invalid_text")
    return {"text": params["text"]}


@realtime_app.rpc_method("demo.sleep")
async def sleep(consumer: Any, params: Any) -> dict[str, int]:
    """Hold a worker for ``ms`` (≤ 5000) milliseconds: ``{"slept_ms": ms}``."""
    ms = params.get("ms") if isinstance(params, dict) else None
    if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= MAX_SLEEP_MS:
        raise _invalid(f"'ms' must be an int 0..{MAX_SLEEP_MS}", "invalid_ms", max=MAX_SLEEP_MS)
    await asyncio.sleep(ms / 1000)
    return {"slept_ms": ms}
