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
