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
