"""Which channels exist: cadenced families, exact state channels, event channels, and
templates of each (a channel per object).

A **family** owns ``base`` and every ``base:<ms>``; its factory is called when one of
those channels gets its first subscriber in the cluster and its cleanup after the last
leaves. An **app-fed** family has no factory: the application sets its value
(``publish(base, value)``) and each cadence delivers the latest at most once a period.
An **exact** channel is one fixed state channel with an optional factory. An **event**
channel is published by application code only and never cadenced.

Any of them may be a **template** (``lot:<int:id>``, :mod:`~realtime_app.declarations.templates`):
its instances are resolved by name when used, never listed; ``exists`` says which are
real, ``owner`` names the parameter that must be the subscriber's user id.

Registration happens at import time of each app's ``realtime_channels`` module, with the
functions of :mod:`~realtime_app.declarations.declare`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from realtime_app.declarations.templates import Template, compile_template, is_template
from realtime_app.exceptions import ConfigurationError, UnknownChannel
from realtime_app.wire.history import HistoryPolicy
from realtime_app.wire.rate import RateBounds, is_rate_channel, parse_rate, rate_channel

__all__ = [
    "FED_PREFIX",
    "STATE_TTL_S",
    "ChannelKind",
    "ChannelSpec",
    "Declared",
    "Family",
    "Registry",
    "fed_channel",
    "registry",
]

logger = logging.getLogger("realtime_app.registry")

#: The backplane channel of the cluster's own control messages (``hub.CONTROL_CHANNEL``).
RESERVED = "realtime.control"
#: Names the cluster uses for itself: never a client's channel.
RESERVED_PREFIX = "realtime."
#: The backplane channel that carries an app-fed family's value (``fed_channel``).
FED_PREFIX = "realtime.fed:"
#: Names resolved by templates kept per process (each lookup of a subscribe, a publication,
#: a frame's rule reads it again).
MAX_RESOLVED = 10_000
#: How long the backplane keeps an app-fed value after it was last set, by default.
STATE_TTL_S = 86_400

Publish: TypeAlias = Callable[[Any], None]
Cleanup: TypeAlias = Callable[[], Any]
Factory: TypeAlias = Callable[["ChannelSpec", Publish], "Cleanup | None | Awaitable[Cleanup | None]"]
ChannelKind: TypeAlias = Literal["state", "event"]


@dataclass(frozen=True, slots=True)
class ChannelSpec:
    """A resolved channel: its canonical name and what serves it.

    ``str(spec)`` is the name, so a factory may treat it as the channel string.
    """

    name: str
    kind: ChannelKind
    base: str
    interval_ms: int | None = None
    factory: Factory | None = field(default=None, compare=False, repr=False)
    history: HistoryPolicy | None = None  # event channels that keep their past (docs/recovery.md)
    max_bytes: int = 0  # an event channel's own bound on a publication (0: MAX_PUBLICATION_BYTES)
    fed: HistoryPolicy | None = None  # app-fed: how its value is kept (one, ``ttl_s``) on the backplane
    params: dict[str, Any] = field(default_factory=dict, compare=False)  # a template instance's values
    declared: Declared | None = field(default=None, compare=False, repr=False)  # its template
    presence: bool = False  # who is in it is kept and told (docs/presence.md); one room per family

    def __str__(self) -> str:
        return self.name

    @property
    def has_ticker(self) -> bool:
        """True when something runs (one per cluster) while the channel has subscribers:
        a factory, or an app-fed cadence's pacing."""
        return self.factory is not None or self.fed is not None

    @property
    def template(self) -> str | None:
        """The template this channel is an instance of (``"lot:<int:id>"``), if any."""
        return self.declared.template.pattern if self.declared is not None else None


@dataclass(frozen=True, slots=True)
class Family:
    """A cadenced state family: ``base`` at the default cadence, ``base:<ms>`` otherwise."""

    base: str
    bounds: RateBounds
    factory: Factory | None
    fed: HistoryPolicy | None = None
    params: dict[str, Any] = field(default_factory=dict, compare=False)
    declared: Declared | None = field(default=None, compare=False, repr=False)
    asked: str | None = field(default=None, compare=False, repr=False)  # the base as a name spelt it
    presence: bool = False

    def resolve(self, name: str) -> ChannelSpec | None:
        ms = parse_rate(name, self.asked or self.base, self.bounds)
        if ms is None:
            return None
        canonical = rate_channel(self.base, ms, self.bounds.default)
        return ChannelSpec(
            canonical,
            "state",
            self.base,
            ms,
            self.factory,
            fed=self.fed,
            params=self.params,
            declared=self.declared,
            presence=self.presence,
        )


@dataclass(frozen=True, slots=True)
class Declared:
    """A template declaration: what each of its instances is, and which exist."""

    template: Template
    kind: ChannelKind
    bounds: RateBounds | None = None  # cadenced (a family)
    factory: Factory | None = field(default=None, compare=False)
    fed: HistoryPolicy | None = None
    history: HistoryPolicy | None = None
    max_bytes: int = 0
    exists: Callable[[dict[str, Any]], Any] | None = field(default=None, compare=False)
    owner: str | None = None  # the parameter that must equal the subscriber's user id
    max_instances: int = 0  # 0: MAX_INSTANCES_PER_TEMPLATE
    presence: bool = False
    public: bool = False  # open to every client without a rule (closed by default)

    @property
    def pattern(self) -> str:
        return self.template.pattern

    def family(self, name: str) -> Family | None:
        """The instance family ``name`` is the base or a cadence of (cadenced templates)."""
        if self.bounds is None:
            return None
        params = self.template.match(name)
        asked = name
        if params is None:
            asked, sep, _ = name.rpartition(":")
            params = self.template.match(asked) if sep and is_rate_channel(name, asked) else None
            if params is None:
                return None
        base = self.template.name(params)  # canonical: lot:0042 is lot:42
        return Family(base, self.bounds, self.factory, self.fed, params, self, asked, self.presence)

    def resolve(self, name: str) -> ChannelSpec | None:
        """The instance ``name`` names, canonicalised, or None."""
        if self.bounds is not None:
            fam = self.family(name)
            return fam.resolve(name) if fam is not None else None
        params = self.template.match(name)
        if params is None:
            return None
        name = self.template.name(params)  # canonical: lot:0042 is lot:42
        return ChannelSpec(
            name,
            self.kind,
            name,
            None,
            self.factory,
            self.history,
            self.max_bytes,
            params=params,
            declared=self,
            presence=self.presence,
        )

    def covers(self, name: str) -> bool:
        return self.resolve(name) is not None


class Registry:
    """The channels this process knows, by name and by family base."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}
        self.exact: dict[str, ChannelSpec] = {}
        self.templates: dict[str, Declared] = {}
        self._instances: dict[str, ChannelSpec | None] = {}  # names resolved by a template, bounded

    def clear(self) -> None:
        self.families.clear()
        self.exact.clear()
        self.templates.clear()
        self._instances.clear()

    def _check_free(self, name: str) -> None:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigurationError(f"channel name must be a non-empty string without outer spaces, got {name!r}")
        if name in self.families or name in self.exact or name in self.templates:
            raise ConfigurationError(f"channel {name!r} is already registered")
        if name == RESERVED or name.startswith(RESERVED_PREFIX):
            raise ConfigurationError(f"channel names beginning {RESERVED_PREFIX!r} are the cluster's own, got {name!r}")
        base, _, suffix = name.rpartition(":")
        if base in self.families and suffix.isascii() and suffix.isdigit():
            raise ConfigurationError(f"channel {name!r} is a cadence of family {base!r}")

    def add_family(
        self,
        base: str,
        factory: Factory | None,
        *,
        default: int,
        min: int,
        max: int,
        fed: HistoryPolicy | None = None,
        presence: bool = False,
        **instances: Any,
    ) -> Family | Declared:
        """Register a cadenced family (a template of families when ``base`` has
        parameters); ``default``, ``min``, ``max`` in milliseconds. ``factory`` None and
        ``fed`` set: an app-fed family."""
        self._check_free(base)
        for key, value in (("default", default), ("min", min), ("max", max)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigurationError(
                    f"family {base!r}: {key} must be an int of milliseconds (e.g. {key}=1000), got {value!r}"
                )
        if not 0 < min <= default <= max:
            raise ConfigurationError(
                f"family {base!r}: need 0 < min <= default <= max, got min={min} default={default} max={max}"
            )
        if (factory is None) == (fed is None) or (factory is not None and not callable(factory)):
            raise ConfigurationError(f"family {base!r}: factory must be callable, got {factory!r}")
        bounds = RateBounds(default, min, max)
        if is_template(base):
            return self._add_template(
                base, "state", bounds=bounds, factory=factory, fed=fed, presence=presence, **instances
            )
        _no_instance_options(base, instances)
        fam = Family(base, bounds, factory, fed, presence=presence)
        self.families[base] = fam
        return fam

    def add_channel(
        self,
        name: str,
        kind: ChannelKind,
        factory: Factory | None = None,
        history: HistoryPolicy | None = None,
        max_bytes: int = 0,
        presence: bool = False,
        **instances: Any,
    ) -> ChannelSpec | Declared:
        """Register an exact state channel (optional factory) or an event channel (none,
        optional history); a template of either when ``name`` has parameters."""
        self._check_free(name)
        if kind == "event" and factory is not None:
            raise ConfigurationError(f"event channel {name!r} cannot have a factory: application code publishes it")
        if history is not None and kind != "event":
            raise ConfigurationError(f"channel {name!r}: only event channels keep a history")
        if is_template(name):
            return self._add_template(
                name, kind, factory=factory, history=history, max_bytes=max_bytes, presence=presence, **instances
            )
        _no_instance_options(name, instances)
        spec = ChannelSpec(name, kind, name, None, factory, history, max_bytes, presence=presence)
        self.exact[name] = spec
        return spec

    def _add_template(
        self,
        pattern: str,
        kind: ChannelKind,
        *,
        exists: Callable[[dict[str, Any]], Any] | None = None,
        owner: str | None = None,
        max_instances: int = 0,
        public: bool = False,
        **what: Any,
    ) -> Declared:
        template = compile_template(pattern)
        names = [parameter for parameter, _ in template.converters]
        if exists is not None and not callable(exists):
            raise ConfigurationError(f"channel template {pattern!r}: exists must be callable, got {exists!r}")
        if owner is not None and owner not in names:
            raise ConfigurationError(f"channel template {pattern!r}: owner {owner!r} is none of its parameters {names}")
        if isinstance(max_instances, bool) or not isinstance(max_instances, int) or max_instances < 0:
            raise ConfigurationError(
                f"channel template {pattern!r}: max_instances must be an integer >= 0, got {max_instances!r}"
            )
        if not isinstance(public, bool):
            raise ConfigurationError(f"channel template {pattern!r}: public must be True or False, got {public!r}")
        declared = Declared(
            template, kind, exists=exists, owner=owner, max_instances=max_instances, public=public, **what
        )
        self.templates[pattern] = declared
        self._instances.clear()
        return declared

    def resolve(self, name: str) -> ChannelSpec:
        """The channel ``name`` refers to, canonicalised; raises :class:`UnknownChannel`.
        A template's instance is resolved by name only: whether it exists is
        :func:`~realtime_app.declarations.instances.exists`' to say."""
        spec = self.exact.get(name)
        if spec is not None:
            return spec
        fam = self.families.get(name)
        if fam is None:
            base, sep, _ = name.rpartition(":")
            fam = self.families.get(base) if sep else None
        if fam is not None:
            resolved = fam.resolve(name)
            if resolved is not None:
                return resolved
        if name in self._instances:
            resolved = self._instances[name]
        else:
            resolved = next((r for d in self.templates.values() if (r := d.resolve(name)) is not None), None)
            if len(self._instances) >= MAX_RESOLVED:  # names come from clients: bounded
                self._instances.clear()
            self._instances[name] = resolved
        if resolved is None:
            raise UnknownChannel(name)
        return resolved

    def find(self, name: str) -> ChannelSpec | None:
        """:meth:`resolve`, or None for a name nobody declared."""
        try:
            return self.resolve(name)
        except UnknownChannel:
            return None

    def family_of(self, name: str) -> Family | None:
        """The family whose base or cadence (``base:<ASCII digits>``) ``name`` is, if any;
        ``base:chat`` is not a cadence, so not of the family (its rules do not apply).
        For a cadenced template, the family of the instance (``lot:42`` of ``lot:<int:id>``)."""
        if name in self.families:
            return self.families[name]
        base, sep, _ = name.rpartition(":")
        fam = self.families.get(base) if sep else None
        if fam is not None:
            return fam if is_rate_channel(name, base) else None
        if name in self.exact or not self.templates:
            return None
        spec = self.find(name)  # an instance of a cadenced template (resolved once, then cached)
        declared = spec.declared if spec is not None else None
        if spec is None or declared is None or declared.bounds is None:
            return None
        fed, presence = declared.fed, declared.presence
        return Family(spec.base, declared.bounds, declared.factory, fed, spec.params, declared, presence=presence)

    def declarations(self) -> list[tuple[str, Callable[[str], bool], list[str]]]:
        """Every family and template as ``(name, covers(name) -> bool, sample names)``:
        what the collision check compares (a family's samples include a cadence)."""
        out: list[tuple[str, Callable[[str], bool], list[str]]] = []
        for base, fam in self.families.items():
            out.append((base, _covers(fam), [base, f"{base}:{fam.bounds.max}"]))
        for pattern, declared in self.templates.items():
            samples = list(declared.template.samples())
            if declared.bounds is not None:
                samples += [f"{s}:{declared.bounds.max}" for s in samples]
            out.append((pattern, declared.covers, samples))
        return out

    def collisions(self) -> list[tuple[str, str, str]]:
        """Pairs of declarations that both claim one name: ``(first, second, name)``. Two
        listed names never do (one name, one registration); a listed name is compared
        with each family and template, so thousands of listed channels stay cheap."""
        found = []
        declared = self.declarations()
        for i, (first, covers_first, first_samples) in enumerate(declared):
            for second, covers_second, second_samples in declared[i + 1 :]:
                name = next((s for s in first_samples if covers_second(s)), None)
                if name is None:
                    name = next((s for s in second_samples if covers_first(s)), None)
                if name is not None:
                    found.append((first, second, name))
        for name in self.exact:
            for other, covers, _ in declared:
                if covers(name):
                    found.append((name, other, name))
        return found


def _covers(fam: Family) -> Callable[[str], bool]:
    return lambda name: fam.resolve(name) is not None


def _no_instance_options(name: str, options: dict[str, Any]) -> None:
    """``exists``, ``owner`` and ``max_instances`` belong to templates (``public`` too, but a
    channel of one name is open until a rule guards it: saying so is no mistake)."""
    given = sorted(k for k, v in options.items() if v not in (None, 0) and k != "public")
    if given:
        raise ConfigurationError(f"channel {name!r}: {given} apply to channel templates (a name with <parameters>)")


registry = Registry()


def fed_channel(base: str) -> str:
    """The backplane channel that carries the value of the app-fed family ``base``."""
    return FED_PREFIX + base
