"""Channel name → Channels group name, deterministic and collision-free.

Group names allow only ASCII letters, digits, ``-``, ``_`` and ``.`` and must be shorter
than 100 characters. Letters, digits and ``-`` are kept; ``:`` becomes ``.``; ``_``
becomes ``__``; any other character becomes ``_xx`` per UTF-8 byte. That escaping is
injective, so two names never share a group. Names whose escaped form would be too long
are hashed under another prefix (SHA-256, 160 bits), which cannot meet an escaped name.
"""

from __future__ import annotations

import hashlib

__all__ = ["group_name"]

_KEEP = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_ESCAPED_PREFIX = "rt.c."
_HASHED_PREFIX = "rt.h."
_MAX_ESCAPED = 99 - len(_ESCAPED_PREFIX)


def _escape(name: str) -> str:
    out: list[str] = []
    for char in name:
        if char in _KEEP:
            out.append(char)
        elif char == ":":
            out.append(".")
        elif char == "_":
            out.append("__")
        else:
            out.extend(f"_{byte:02x}" for byte in char.encode("utf-8", "surrogatepass"))
    return "".join(out)


def group_name(channel: str) -> str:
    """The Channels group that carries ``channel`` between processes."""
    escaped = _escape(channel)
    if len(escaped) <= _MAX_ESCAPED:
        return _ESCAPED_PREFIX + escaped
    digest = hashlib.sha256(channel.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return _HASHED_PREFIX + digest
