"""The admin's "Realtime cluster" screen hangs off an unmanaged model: no table, no rows."""

from django.db import models


class RealtimeCluster(models.Model):
    """Not stored: the admin entry of the live cluster screen."""

    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = "Realtime cluster"
        verbose_name_plural = "Realtime cluster"

    def __str__(self) -> str:
        return "Realtime cluster"
