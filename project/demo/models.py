"""The demo's persisted state: each user's inventory, written behind the hot path."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class InventoryItem(models.Model):
    """Shots left of one item for one user. Written only through the write-behind store
    (``project.demo.inventory.store``): ``shots`` is a counter, flushed as deltas."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="inventory")
    item = models.CharField(max_length=64)
    shots = models.IntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "item"], name="demo_inventory_user_item"),
            models.CheckConstraint(condition=models.Q(shots__gte=0), name="demo_inventory_shots_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} {self.item}: {self.shots}"


class AuctionLot(models.Model):
    """One lot of the demo auction (ids 1..1000, made by the migration): its channel is
    ``demo:lot:<id>``, an app-fed state channel published on every bid."""

    price = models.PositiveIntegerField(default=0)
    bids = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"lot {self.pk}: {self.price} after {self.bids} bids"

    def state(self) -> dict[str, int]:
        """The channel's value: ``{"lot", "price", "bids"}``."""
        return {"lot": self.pk, "price": self.price, "bids": self.bids}


class RoomMessage(models.Model):
    """A message posted in a demo chat room (``demo:room:<name>``)."""

    room = models.SlugField(max_length=64, db_index=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    text = models.CharField(max_length=500)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.room}: {self.text[:40]}"
