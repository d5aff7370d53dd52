"""A publication as JSON text, checked against its size bound before any ``seq`` is
taken: a publication that cannot be sent must not burn a number."""

from __future__ import annotations

from typing import Any

from realtime_app.conf.runtime import settings
from realtime_app.declarations.registry import ChannelSpec, registry
from realtime_app.exceptions import PublicationError, PublicationTooLarge
from realtime_app.wire.history import new_epoch
from realtime_app.wire.protocol import encode, notification_text

__all__ = ["ENVELOPE_BYTES", "encode_publication", "publication_limit"]

#: The bytes a ``message`` notification adds around its channel and data, at the largest
#: ``seq``, ``epoch`` and ``ts`` it can carry: the bound is on the whole frame.
ENVELOPE_BYTES = len(notification_text("", "", 2**63 - 1, 10**13 - 1, new_epoch()))


def publication_limit(spec: ChannelSpec | None) -> tuple[int, str]:
    """The most bytes a publication of ``spec``'s channel may take (0: no bound) and which
    setting says so: its ``max_bytes`` where that is lower than ``MAX_PUBLICATION_BYTES``."""
    limit, bound = settings().max_publication_bytes, "MAX_PUBLICATION_BYTES"
    if spec is not None and spec.max_bytes and (not limit or spec.max_bytes < limit):
        limit, bound = spec.max_bytes, "the channel's max_bytes"
    return int(limit), bound


def encode_publication(channel: str, data: Any) -> str:
    """``data`` as JSON text; :class:`PublicationError` when it is not JSON,
    :class:`PublicationTooLarge` when the whole frame would exceed
    ``MAX_PUBLICATION_BYTES`` or the channel's ``max_bytes``."""
    try:
        data_json = encode(data)
    except (ValueError, TypeError) as exc:
        raise PublicationError(channel, f"data is not JSON ({exc})") from None
    limit, bound = publication_limit(registry.find(channel))
    size = len(data_json) if data_json.isascii() else len(data_json.encode("utf-8"))
    size += len(encode(channel)) + ENVELOPE_BYTES
    if limit and size > limit:
        raise PublicationTooLarge(channel, size, limit, bound)
    return data_json
