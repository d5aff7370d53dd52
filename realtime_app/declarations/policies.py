"""Channel access rules from settings: who may subscribe to, or publish on, a channel.

A rule is a dict: ``{"pattern": "atelier:", "authenticated": True}``. Patterns:

* without ``*?[``: matches the name itself, and names that continue it after a ``:``
  (``atelier:load`` matches ``atelier:load`` and ``atelier:load:2000``, not
  ``atelier:loader``); a pattern ending in ``:`` is a plain prefix;
* with ``*?[``: a glob (``fnmatchcase``);
* with ``<converter:name>``: a channel template (``lot:<int:id>``), matching its
  instances (and their cadences) as a name without ``*?[`` matches its own.

A cadenced channel is also checked against the rules of its family's base, so a rule
on the base always guards every cadence. The most specific matching rule wins: an exact
name first, then the longest literal part, then a prefix over a glob. A rule that names
cadences of a family (``atelier:load:2000``, ``atelier:load:*``) may only *add* to the
family's rule — both must be met — unless it says ``"override_family": True``, the
explicit opt-in to open some cadences of a guarded family wider than its base.

Requirements: ``authenticated``, ``staff``, ``superuser`` (bools), ``permission`` (a
permission name or a list), ``check`` (a callable ``(user, channel, action) -> bool`` or its
dotted path; for an instance of a template, ``channel.params`` holds its values). Top-level
requirements apply to subscribing; ``subscribe``, ``publish`` and ``presence`` sub-dicts
govern each action (``"publish": True`` allows anyone; ``False`` nobody; ``presence`` —
who may see who is in a presence channel — is the subscribe rule unless given). Clients may publish only
where a rule says so. A template declared with ``owner="id"`` is only its user's
(``user:<int:id>`` for the user whose pk is ``id``), whatever the rules say.

Closed by default: an instance of a template (``order:42`` of ``order:<int:id>``), owner's
or not, is refused to every client until a rule matches it — unless the template is
declared ``public=True``. A per-object channel is almost always private, and a rule whose
pattern is misspelt must not leave it open to everyone (check E015 names such a rule).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from django.utils.module_loading import import_string

from realtime_app.declarations.templates import ChannelName, Template, compile_template, is_template

__all__ = [
    "Action",
    "Requirement",
    "Rule",
    "active_rules",
    "backpressure_policy",
    "frame_policy",
    "Rules",
    "allowed",
    "compile_rules",
    "evaluate",
    "matching_rule",
    "owns",
    "requirement_for",
]

Action: TypeAlias = Literal["subscribe", "publish", "presence"]

REQUIREMENT_KEYS = frozenset({"authenticated", "staff", "superuser", "permission", "check"})
RULE_KEYS = REQUIREMENT_KEYS | {"pattern", "subscribe", "publish", "presence", "override_family", "backpressure"}
BACKPRESSURE_CHOICES = ("drop", "close", "conflate")
_GLOB_CHARS = frozenset("*?[")
_BRACKETS = re.compile(r"\[!?\]?[^\]]*\]")  # one fnmatch bracket expression


@dataclass(frozen=True, slots=True)
class Requirement:
    """What a user needs for one action; ``allowed=False`` refuses everyone."""

    allowed: bool = True
    authenticated: bool = False
    staff: bool = False
    superuser: bool = False
    permissions: tuple[str, ...] = ()
    check: Callable[[Any, str, str], bool] | None = None

    @property
    def needs_database(self) -> bool:
        """Permission and custom checks may query the database: run them off the loop."""
        return bool(self.permissions) or self.check is not None

    def implies(self, other: Requirement) -> bool:
        """True when whoever meets ``self`` meets ``other`` (conservatively: False when unsure)."""
        if not self.allowed:
            return True
        if not other.allowed:
            return False
        identified = self.authenticated or self.staff or self.superuser or bool(self.permissions)
        return (
            (not other.authenticated or identified)
            and (not other.staff or self.staff)
            and (not other.superuser or self.superuser)
            and set(other.permissions) <= set(self.permissions)
            and (other.check is None or other.check is self.check)
        )

    def both(self, other: Requirement) -> Requirement:
        """The requirement of meeting ``self`` and ``other``."""
        checks = [c for c in (self.check, other.check) if c is not None]
        check: Callable[[Any, str, str], bool] | None = checks[0] if len(checks) == 1 else None
        if len(checks) == 2:
            first, second = checks

            def check(user: Any, channel: str, action: str) -> bool:
                return bool(first(user, channel, action)) and bool(second(user, channel, action))

        return Requirement(
            allowed=self.allowed and other.allowed,
            authenticated=self.authenticated or other.authenticated,
            staff=self.staff or other.staff,
            superuser=self.superuser or other.superuser,
            permissions=tuple(dict.fromkeys((*self.permissions, *other.permissions))),
            check=check,
        )


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    subscribe: Requirement
    publish: Requirement
    index: int  # position in settings, for messages
    override_family: bool = False  # may open cadences wider than the family's own rule
    backpressure: str | None = None  # "drop" | "close" | "conflate" for the channels it matches
    template: Template | None = None  # the pattern is a channel template
    presence: Requirement | None = None  # who may see who is in it; None: as subscribe

    @property
    def is_glob(self) -> bool:
        return self.template is None and any(c in _GLOB_CHARS for c in self.pattern)

    def literal_length(self) -> int:
        """Characters matched literally: ``[...]`` counts as none, like ``?``."""
        if self.template is not None:
            return self.template.literal_length()
        return sum(1 for c in _BRACKETS.sub("", self.pattern) if c not in "*?")

    def matches(self, name: str) -> bool:
        p = self.pattern
        if self.template is not None:  # the instance, or a name that continues it after a ":"
            if self.template.match(name) is not None:
                return True
            head = name
            while ":" in head:
                head = head.rpartition(":")[0]
                if self.template.match(head) is not None:
                    return True
            return False
        if self.is_glob:
            return fnmatch.fnmatchcase(name, p)
        if p.endswith(":"):
            return name.startswith(p)
        return name == p or name.startswith(p + ":")

    def specificity(self, name: str) -> tuple[int, int, int]:
        """Exact name first, then the most literal text, then a template (it names
        instances) over a prefix, over a glob."""
        rank = 2 if self.template is not None else int(not self.is_glob)
        return (int(name == self.pattern), self.literal_length(), rank)

    def requirement(self, action: Action) -> Requirement:
        if action == "presence":
            return self.presence if self.presence is not None else self.subscribe
        return self.subscribe if action == "subscribe" else self.publish


def _requirement(spec: Any, where: str) -> Requirement:
    if isinstance(spec, bool):
        return Requirement(allowed=spec)
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a dict or a bool, got {spec!r}")
    unknown = set(spec) - REQUIREMENT_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected some of {sorted(REQUIREMENT_KEYS)}")
    perms = spec.get("permission", ())
    if isinstance(perms, str):
        perms = (perms,)
    if not all(isinstance(p, str) for p in perms):
        raise ValueError(f"{where}: 'permission' must be a string or a list of strings, got {perms!r}")
    check = spec.get("check")
    if isinstance(check, str):
        check = import_string(check)
    if check is not None and not callable(check):
        raise ValueError(f"{where}: 'check' must be callable or a dotted path, got {check!r}")
    for key in ("authenticated", "staff", "superuser"):
        if key in spec and not isinstance(spec[key], bool):
            raise ValueError(f"{where}: {key!r} must be a bool, got {spec[key]!r}")
    return Requirement(
        allowed=True,
        authenticated=spec.get("authenticated", False),
        staff=spec.get("staff", False),
        superuser=spec.get("superuser", False),
        permissions=tuple(perms),
        check=check,
    )


def compile_rules(raw: Iterable[Any]) -> list[Rule]:
    """Validate and compile the rules of the settings; raises ``ValueError`` naming the rule."""
    _a_list(raw)
    rules = []
    for index, spec in enumerate(raw):
        where = f"POLICIES[{index}]"
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected a dict, got {spec!r}")
        pattern = spec.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where}: 'pattern' must be a non-empty string, got {pattern!r}")
        template = None
        if is_template(pattern):
            try:
                template = compile_template(pattern)
            except Exception as exc:
                raise ValueError(f"{where}: {exc}") from None
        else:
            _require_balanced(pattern, where)
        override = spec.get("override_family", False)
        if not isinstance(override, bool):
            raise ValueError(f"{where}: 'override_family' must be a bool, got {override!r}")
        backpressure = spec.get("backpressure")
        if backpressure is not None and backpressure not in BACKPRESSURE_CHOICES:
            raise ValueError(
                f"{where}: 'backpressure' must be one of {list(BACKPRESSURE_CHOICES)}, got {backpressure!r}"
            )
        unknown = set(spec) - RULE_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected some of {sorted(RULE_KEYS)}")
        top = {k: v for k, v in spec.items() if k in REQUIREMENT_KEYS}
        base = _requirement(top, where)
        subscribe = _requirement(spec["subscribe"], f"{where}.subscribe") if "subscribe" in spec else base
        publish = _requirement(spec["publish"], f"{where}.publish") if "publish" in spec else Requirement(allowed=False)
        presence = _requirement(spec["presence"], f"{where}.presence") if "presence" in spec else None
        rules.append(Rule(pattern, subscribe, publish, index, override, backpressure, template, presence))
    return rules


def _require_balanced(pattern: str, where: str) -> None:
    """Refuse a glob whose ``[`` has no ``]``: fnmatch would quietly read it as a literal."""
    i = 0
    while (i := pattern.find("[", i)) != -1:
        close = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "]") else i + 1)
        if close == -1:
            raise ValueError(f"{where}: pattern {pattern!r} has a '[' without a closing ']'")
        i = close + 1


def matching_rule(rules: Iterable[Rule], name: str, base: str | None = None) -> Rule | None:
    """The most specific rule for ``name`` (or for its family ``base``); None if none."""
    best: Rule | None = None
    best_key: tuple[int, int, int] | None = None
    for rule in rules:
        if rule.matches(name):
            key = rule.specificity(name)
        elif base is not None and base != name and rule.matches(base):
            key = rule.specificity(base)
        else:
            continue
        if best_key is None or key > best_key:
            best, best_key = rule, key
    return best


DEFAULT_SUBSCRIBE = Requirement(allowed=True)
DEFAULT_PUBLISH = Requirement(allowed=False)


def requirement_for(rules: Iterable[Rule], name: str, base: str | None, action: Action) -> Requirement:
    """What ``action`` on ``name`` requires: its most specific rule, and for a cadence of a
    family also the family's own rule (unless the cadence's rule overrides the family)."""
    rules = list(rules)
    rule = matching_rule(rules, name, base)
    if rule is None:
        return DEFAULT_PUBLISH if action == "publish" else DEFAULT_SUBSCRIBE
    requirement = rule.requirement(action)
    if base is not None and name != base and not rule.override_family:
        family_rule = matching_rule(rules, base)
        if family_rule is not None and family_rule is not rule:
            requirement = requirement.both(family_rule.requirement(action))
    return requirement


def evaluate(req: Requirement, user: Any, channel: str, action: Action) -> bool:
    """Whether ``user`` meets ``req``. May query the database when ``req.needs_database``."""
    if not req.allowed:
        return False
    if req.authenticated and not getattr(user, "is_authenticated", False):
        return False
    if req.staff and not (getattr(user, "is_active", False) and getattr(user, "is_staff", False)):
        return False
    if req.superuser and not (getattr(user, "is_active", False) and getattr(user, "is_superuser", False)):
        return False
    if req.permissions and not (user is not None and user.has_perms(req.permissions)):
        return False
    if req.check is not None and not req.check(user, channel, action):
        return False
    return True


def _a_list(raw: Any) -> None:
    if isinstance(raw, dict):
        raise ValueError(
            'POLICIES: expected a list of rules, e.g. [{"pattern": "chat:", "authenticated": True}], got a dict'
        )
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise ValueError(f"POLICIES: expected a list of rules, got {raw!r}")


def configured_rules(config: dict[str, Any]) -> list[Rule]:
    """The rules of the settings, compiled: the user's ``POLICIES``, then the built-in ones."""
    _a_list(config["POLICIES"])
    return compile_rules([*config["POLICIES"], *config["BUILTIN_POLICIES"]])


class Rules:
    """The process's compiled rules and the backpressure policy found per channel (a part
    of its runtime), both dropped when the settings change."""

    def __init__(self) -> None:
        self.compiled: list[Rule] | None = None
        self.policies: dict[str, str | None] = {}

    def settings_changed(self) -> None:
        self.compiled = None
        self.policies = {}


def active_rules() -> list[Rule]:
    """The compiled rules of the settings: the user's, then the built-in ones."""
    from realtime_app.conf.runtime import runtime

    kept = runtime().part(Rules)
    if kept.compiled is None:
        config = runtime().settings
        kept.compiled = configured_rules({"POLICIES": config.policies, "BUILTIN_POLICIES": config.builtin_policies})
    return kept.compiled


async def allowed(user: Any, name: str, base: str | None, action: Action) -> bool:
    """Whether ``user`` may ``action`` the channel ``name`` (of family ``base``): its
    template's owner only, if it names one, and as the rules say. A ``check`` is given
    the name as a :class:`ChannelName` (``channel.params``)."""
    from realtime_app.declarations.registry import registry

    spec = registry.find(name)
    channel: str = name
    rules = active_rules()
    if spec is not None and spec.declared is not None:
        if spec.declared.owner is not None and not owns(user, spec.params[spec.declared.owner]):
            return False
        if not spec.declared.public and matching_rule(rules, name, base) is None:
            return False  # closed by default: a per-object channel no rule names is nobody's
        channel = ChannelName(name, spec.params, spec.declared.pattern)
    req = requirement_for(rules, name, base, action)
    if req.needs_database:
        from channels.db import database_sync_to_async

        return bool(await database_sync_to_async(evaluate)(req, user, channel, action))
    return evaluate(req, user, channel, action)


def owns(user: Any, value: Any) -> bool:
    """Whether ``value`` (an ``owner`` parameter) is this signed-in, active user's pk."""
    if not getattr(user, "is_authenticated", False) or not getattr(user, "is_active", True):
        return False
    return str(user.pk) == str(value)


def backpressure_policy(name: str, base: str | None = None) -> str | None:
    """The ``"backpressure"`` of the most specific rule that sets one for channel ``name``
    (or its family ``base``); None: the global ``BACKPRESSURE_POLICY``. Read per frame:
    answered from a cache per channel, emptied when the settings change."""
    from realtime_app.conf.runtime import runtime

    found = runtime().part(Rules).policies
    try:
        return found[name]
    except KeyError:
        pass
    rule = matching_rule([r for r in active_rules() if r.backpressure is not None], name, base)
    if len(found) >= 10_000:  # channels come and go: bounded all the same
        found.clear()
    policy = found[name] = rule.backpressure if rule is not None else None
    return policy


def frame_policy(name: str) -> str | None:
    """What a frame of channel ``name`` does over the threshold, when not the global
    policy: ``"conflate"`` for a state channel whose rule says so (an event channel is
    never conflated: every message counts, and channels with history resume instead),
    ``"drop"`` or ``"close"``."""
    from realtime_app.declarations.registry import registry

    family = registry.family_of(name)
    policy = backpressure_policy(name, family.base if family is not None else None)
    if policy == "conflate" and family is None:
        try:
            kind = registry.resolve(name).kind
        except Exception:  # not a registered channel (any more): the global policy
            return None
        if kind != "state":
            return None
    return policy
