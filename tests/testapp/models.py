"""A model with plain fields and a counter, for the write-behind tests."""

from __future__ import annotations

from django.db import models


class Profile(models.Model):
    """``nickname`` and ``color`` are plain fields (last writer wins per field); ``score`` a counter."""

    handle = models.CharField(max_length=32, unique=True)
    nickname = models.CharField(max_length=32, default="")
    color = models.CharField(max_length=16, default="")
    score = models.IntegerField(default=0)

    def __str__(self) -> str:
        return self.handle


class Lot(models.Model):
    """A user's own model, as an auction site has it: a required field with no default
    (``ends_at``), a counter (``bid_count``), a balance in a ``DecimalField`` and a check."""

    code = models.SlugField(unique=True)
    title = models.CharField(max_length=100)
    ends_at = models.DateTimeField()
    bid_count = models.IntegerField(default=0)
    balance = models.DecimalField(max_digits=12, decimal_places=2, default=0)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(balance__gte=0), name="testapp_lot_balance_not_negative")
        ]

    def __str__(self) -> str:
        return self.code
