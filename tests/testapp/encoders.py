"""A project's own JSON encoder, named by ``JSON_ENCODER`` in a test: sets as sorted lists."""

from __future__ import annotations

from typing import Any

from django.core.serializers.json import DjangoJSONEncoder


class SetEncoder(DjangoJSONEncoder):
    def default(self, o: Any) -> Any:
        if isinstance(o, set | frozenset):
            return sorted(o)
        return super().default(o)
