"""Channels per object in the demo (SPEC §12): a chat room per name and an auction lot
per id, each declared once as a template.

* ``demo:room:<slug:name>`` — an event channel per room, history 100 publications / 300 s,
  presence on (who is in the room); anyone may read, a signed-in user posts with ``demo.post``.
* ``demo:lot:<int:id>`` — an app-fed state channel per lot (1..1000, rows of
  :class:`~project.demo.models.AuctionLot`): ``demo.bid`` sets its value, each cadence
  (``demo:lot:<id>:250`` …) delivers the latest at its pace.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import transaction

import realtime_app
from realtime_app.exceptions import RPCError

from .models import AuctionLot, RoomMessage

ROOM = "demo:room:<slug:name>"
LOT = "demo:lot:<int:id>"
MAX_TEXT = 500
_SLUG = re.compile(r"[-a-zA-Z0-9_]{1,64}")


def lot_exists(params: dict[str, Any]) -> bool:
    """Whether lot ``params["id"]`` is in the database (asked once per lot per 30 s). An id
    no database column holds (``lot:99999999999999999999``) is no lot: not a query."""
    return 0 < params["id"] < 2**63 and AuctionLot.objects.filter(pk=params["id"]).exists()


realtime_app.event_channel(
    ROOM, history_size=100, history_ttl_s=300, max_bytes=4096, durable=True, presence=True, public=True
)
realtime_app.app_state(LOT, default=1000, min=100, max=10000, exists=lot_exists, public=True)


def _invalid(message: str, reason: str, **data: Any) -> RPCError:
    return RPCError(-32602, f"Invalid params: {message}", reason, **data)


def _signed_in(consumer: Any) -> Any:
    user = consumer.user
    if user is None or not getattr(user, "is_authenticated", False):
        raise RPCError(-32001, "Sign in first", "not_signed_in")
    return user


@realtime_app.rpc_method("demo.post", rate=5, burst=10, idempotent=True)
def post(consumer: Any, params: Any) -> dict[str, Any]:
    """``{"room": name, "text": str}``: save the message and publish
    ``{"user", "text"}`` on ``demo:room:<name>``, in one transaction: the publication
    goes out when it commits. ``"fail": true`` raises after publishing, inside the
    transaction: nothing is saved, and nothing is delivered."""
    user = _signed_in(consumer)
    if not isinstance(params, dict):
        raise _invalid('expected {"room": name, "text": str}', "invalid_params")
    room, text = params.get("room"), params.get("text")
    if not isinstance(room, str) or not _SLUG.fullmatch(room):
        raise _invalid("'room' must be a slug of 1..64 characters", "invalid_room")
    if not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT:
        raise _invalid(f"'text' must be a string of 1..{MAX_TEXT} characters", "invalid_text", max=MAX_TEXT)
    with transaction.atomic():
        message = RoomMessage.objects.create(room=room, user=user, text=text)
        realtime_app.publish(f"demo:room:{room}", {"user": user.get_username(), "text": text})  # on commit
        if params.get("fail") is True:
            raise RPCError(-32000, "Failed on purpose: nothing was saved", "failed_on_purpose")
    return {"room": room, "id": message.pk}


@realtime_app.rpc_method("demo.bid", rate=10, burst=20, idempotent=True)
def bid(consumer: Any, params: Any) -> dict[str, int]:
    """``{"lot": id, "amount": int}``: raise the lot's price to ``amount`` when it is
    higher, and publish the lot's new value on commit; returns it (``{"lot", "price",
    "bids"}``). Idempotent: sent again with its ``"idempotency_key"`` (a client's retry
    after a reconnect), it bids once and answers what the first call answered."""
    _signed_in(consumer)
    if not isinstance(params, dict):
        raise _invalid('expected {"lot": id, "amount": int}', "invalid_params")
    lot_id, amount = params.get("lot"), params.get("amount")
    if isinstance(lot_id, bool) or not isinstance(lot_id, int):
        raise _invalid("'lot' must be an int", "invalid_lot")
    if isinstance(amount, bool) or not isinstance(amount, int) or not 0 < amount < 2**31:
        raise _invalid("'amount' must be a positive int", "invalid_amount")
    with transaction.atomic():
        lot = AuctionLot.objects.select_for_update().filter(pk=lot_id).first()
        if lot is None:
            raise RPCError(-32002, "Unknown lot", "unknown_lot", lot=lot_id)
        if amount > lot.price:
            lot.price, lot.bids = amount, lot.bids + 1
            lot.save(update_fields=["price", "bids"])
            realtime_app.publish(f"demo:lot:{lot.pk}", lot.state())  # sent on commit: only what was kept
    return lot.state()


def lot_state(lot_id: int) -> dict[str, int] | None:
    """A lot's value as the database has it (the pages render it first)."""
    lot = AuctionLot.objects.filter(pk=lot_id).first()
    return lot.state() if lot is not None else None
