"""Which rules of ``POLICIES`` guard nothing: a pattern that matches no declared channel,
family, cadence or template is a typo (``ordr:<int:id>`` for ``order:<int:id>``) or a
module that was never imported — and with per-object channels closed by default, the
channel it meant is refused to everyone instead of guarded. One rule, read by the system
check (E015) and by the hub at start (an ERROR in the server's log: daphne runs no checks)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from realtime_app.declarations.policies import Rule
from realtime_app.declarations.registry import Family, Registry

__all__ = ["cadences_matched", "unmatched_rules"]


def cadences_matched(rule: Rule, fam: Family) -> Iterator[str]:
    """``fam``'s cadence names (``base:<ms>``, not the default) ``rule`` matches, exactly."""
    base, (default, low, high) = fam.base, fam.bounds
    if not rule.is_glob:
        prefix = f"{base}:"
        if rule.pattern.startswith(prefix) and rule.pattern != prefix:
            digits = rule.pattern[len(prefix) :]
            ok = digits.isascii() and digits.isdigit() and str(int(digits)) == digits
            if ok and low <= int(digits) <= high and int(digits) != default:
                yield rule.pattern
            return
        if not rule.matches(f"{base}:{low if low != default else high}"):
            return  # a literal pattern matches all cadences of a family or none
    for ms in range(low, high + 1):
        name = f"{base}:{ms}"
        if ms != default and rule.matches(name):
            yield name


def unmatched_rules(rules: list[Rule], registry: Registry) -> list[tuple[Rule, str, bool]]:
    """The rules of ``rules`` (the user's, compiled) that match no declared channel, each
    with a hint and whether that is certain. It is, unless the rule's literal part and a
    template's overlap (``tenant:acme:`` and ``tenant:<slug:t>:orders``, ``lot:<int:id>:500``
    and ``lot:<int:id>``): then the answer rests on the template's sample names, a doubt
    rather than a verdict. None while nothing is declared."""
    if not (registry.exact or registry.families or registry.templates):
        return []
    samples = [s for d in registry.templates.values() for s in itertools.islice(d.template.samples(), 8)]
    names = [*registry.exact, *registry.families, *samples]
    literals = [_literal(pattern) for pattern in registry.templates]
    found = []
    for rule in rules:
        if any(rule.matches(name) for name in names):
            continue
        if any(next(cadences_matched(rule, fam), None) for fam in registry.families.values()):
            continue
        defaults = (f"{base}:{fam.bounds.default}" for base, fam in registry.families.items())
        default_name = next((name for name in defaults if rule.matches(name)), None)
        hint = "Check the spelling, or that the module registering it is imported."
        if default_name is not None:
            hint = f"{default_name!r} is a family's default cadence, named by its base: write the base instead."
        mine = _literal(rule.pattern)
        doubt = any(mine.startswith(theirs) or theirs.startswith(mine) for theirs in literals)
        found.append((rule, hint, not doubt))
    return found


def _literal(pattern: str) -> str:
    """What a pattern says literally before its first parameter or glob character."""
    return re.split(r"[<*?\[]", pattern, maxsplit=1)[0]
