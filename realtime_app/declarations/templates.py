"""Channel templates: one declaration for a channel per object (``lot:<int:id>``).

A template uses Django's path-converter syntax (``int``, ``slug``, ``uuid``, ``str`` and
converters registered with :func:`django.urls.register_converter`); the values of an
instance are converted as a URL's are and become ``channel.params``. A parameter never
spans a ``:`` — that separator ends a cadence suffix (``lot:42:2000`` is instance 42 at
2000 ms) — so ``str`` matches one segment here (no ``:``, ``/`` or control character),
and a converter whose pattern accepts a ``:`` (``path``) is refused.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from django.urls.converters import get_converters

from realtime_app.exceptions import ConfigurationError

__all__ = ["ChannelName", "Template", "compile_template", "is_template"]

_PARAMETER = re.compile(r"<(?:(?P<converter>[^>:]+):)?(?P<parameter>[^>]+)>")
#: What ``str`` means in a channel name: one segment, no ``:``, no ``/``, no control
#: character (a NUL reaching a database through an ``exists`` hook is an error there).
_SEGMENT = "[^/:\x00-\x1f\x7f]+"
#: Strings with a ``:`` a converter's pattern must refuse.
_COLONS = (":", "a:b", "1:2", "x:1", "0:0:0", "a-b:c_d")
#: Candidate values for the collision check (each kept where its converter accepts it).
_SAMPLES = ("1", "42", "0", "a", "lobby", "a-b", "A_1", "x.y", "00000000-0000-4000-8000-000000000000", "é")


class ChannelName(str):
    """A channel's name (a ``str``) with its template's converted values: what a policy
    ``check(user, channel, action)`` receives, so a rule reads ``channel.params``."""

    params: Mapping[str, Any]
    template: str | None

    def __new__(cls, name: str, params: Mapping[str, Any] | None = None, template: str | None = None) -> ChannelName:
        self = super().__new__(cls, name)
        self.params = dict(params or {})
        self.template = template
        return self


def is_template(name: str) -> bool:
    """True when ``name`` declares parameters (``<int:id>``)."""
    return isinstance(name, str) and "<" in name


@dataclass(frozen=True, slots=True)
class Template:
    """A compiled channel template: what it matches and how its values convert."""

    pattern: str
    regex: re.Pattern[str]
    converters: tuple[tuple[str, Any], ...]  # (parameter, converter) in order

    def match(self, name: str) -> dict[str, Any] | None:
        """The converted values of ``name``, or None when it is not an instance."""
        found = self.regex.fullmatch(name)
        if found is None:
            return None
        params: dict[str, Any] = {}
        for parameter, converter in self.converters:
            try:
                params[parameter] = converter.to_python(found.group(parameter))
            except ValueError:  # as Django's URL resolver: not a match
                return None
        return params

    def name(self, params: Mapping[str, Any]) -> str:
        """The canonical name of the instance with ``params`` (each value through its
        converter's ``to_url``): ``lot:0042`` and ``lot:42`` are one channel, ``lot:42``."""
        values = iter(str(converter.to_url(params[parameter])) for parameter, converter in self.converters)
        return _fill(self.pattern, values)

    def literal_length(self) -> int:
        """Characters matched literally (for the specificity of a policy rule)."""
        return len(_PARAMETER.sub("", self.pattern))

    def samples(self) -> Iterator[str]:
        """Some names this template matches (each parameter from :data:`_SAMPLES`):
        what the collision check tries on the other declarations."""
        choices = []
        for _, converter in self.converters:
            accepted = [s for s in _SAMPLES if re.fullmatch(converter.regex, s) and _converts(converter, s)]
            choices.append(accepted[:4] or [])
        for values in itertools.product(*choices):
            yield _fill(self.pattern, iter(values))


def _converts(converter: Any, value: str) -> bool:
    try:
        converter.to_python(value)
    except ValueError:
        return False
    return True


def _fill(pattern: str, values: Iterator[str]) -> str:
    return _PARAMETER.sub(lambda _: next(values), pattern)


def compile_template(pattern: str) -> Template:
    """Compile ``pattern`` (``"bids:<int:lot>"``); :class:`ConfigurationError` naming
    what is wrong: an unknown converter, a repeated or invalid parameter, a converter
    that would match a ``:``, or ``<``/``>`` outside a parameter."""
    converters = get_converters()
    parts: list[str] = []
    found: list[tuple[str, Any]] = []
    end = 0
    for match in _PARAMETER.finditer(pattern):
        literal = pattern[end : match.start()]
        if "<" in literal or ">" in literal:
            raise ConfigurationError(f"channel template {pattern!r}: unbalanced '<' or '>' in {literal!r}")
        parts.append(re.escape(literal))
        end = match.end()
        parameter = match.group("parameter")
        name = match.group("converter") or "str"
        if not parameter.isidentifier():
            raise ConfigurationError(f"channel template {pattern!r}: parameter {parameter!r} is not an identifier")
        if parameter in dict(found):
            raise ConfigurationError(f"channel template {pattern!r}: parameter {parameter!r} appears twice")
        converter = converters.get(name)
        if converter is None:
            raise ConfigurationError(
                f"channel template {pattern!r}: unknown converter {name!r}; "
                f"known: {sorted(converters)} (add one with django.urls.register_converter)"
            )
        regex = _SEGMENT if name == "str" else converter.regex
        if name != "str" and any(re.fullmatch(regex, text) for text in _COLONS):
            raise ConfigurationError(
                f"channel template {pattern!r}: converter {name!r} matches ':', which ends a channel's cadence "
                "suffix; use a converter of one segment (int, slug, uuid, str)"
            )
        found.append((parameter, _Segment(converter) if name == "str" else converter))
        parts.append(f"(?P<{parameter}>{regex})")
    tail = pattern[end:]
    if "<" in tail or ">" in tail:
        raise ConfigurationError(f"channel template {pattern!r}: unbalanced '<' or '>' in {tail!r}")
    if not found:
        raise ConfigurationError(f"channel template {pattern!r} declares no parameter")
    parts.append(re.escape(tail))
    return Template(pattern, re.compile("".join(parts)), tuple(found))


class _Segment:
    """Django's ``str`` converter limited to one segment of a channel name."""

    regex = _SEGMENT

    def __init__(self, converter: Any) -> None:
        self.converter = converter

    def to_python(self, value: str) -> Any:
        return self.converter.to_python(value)

    def to_url(self, value: Any) -> str:
        return str(self.converter.to_url(value))
