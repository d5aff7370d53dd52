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


class FlushMark(models.Model):
    """One row per write-behind batch, written in the batch's own transaction: when the
    outcome of a write is unknown (the connection dropped at COMMIT, the flush was
    cancelled), the next flush looks its token up and settles instead of applying counter
    deltas twice. Marks older than an hour are deleted by the flushes — but for those of
    batches written from a journal, kept for good: a journal file put back (a restored
    backup, a copy) is never applied twice, however old."""

    token = models.CharField(max_length=32, primary_key=True)
    created = models.DateTimeField(db_index=True)
    journaled = models.BooleanField(default=False)

    class Meta:
        verbose_name = "write-behind flush mark"

    def __str__(self) -> str:
        return str(self.token)


class OutboxEntry(models.Model):
    """A publication of a durable channel made inside a transaction, written in that
    transaction: published once it committed (in order per channel, each exactly once:
    its id is its idempotency key on the backplane), then deleted. Rows of a transaction
    that rolled back never exist (docs/transactions.md)."""

    channel = models.CharField(max_length=200)
    data = models.TextField()  # the publication's JSON text
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "outbox entry"
        verbose_name_plural = "outbox"
        indexes = [models.Index(fields=["channel", "id"], name="realtime_outbox_channel")]

    def __str__(self) -> str:
        return f"{self.channel} #{self.pk}"
