"""System checks: configuration errors at startup, not at the first frame.

Ids are stable and listed in docs/checks.md.
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register

from .conf import DEFAULTS, get_config
from .policies import Rule, compile_rules, matching_rule
from .registry import registry

__all__ = ["check_policies", "check_server_versions", "check_settings"]

_INT_SETTINGS = {
    "MAX_FRAME_BYTES": 0,
    "MAX_BATCH": 1,
    "MAX_CHANNEL_NAME": 1,
    "MAX_SUBSCRIPTIONS": 0,
    "LEASE_TTL_MS": 300,
    "PROBE_TTL_MS": 300,
    "MAX_BACKPRESSURE": 0,
    "CLOSE_AFTER_DROPS": 0,
    "SLOW_CONSUMER_BYTES": 0,
    "CLOSE_DRAIN_MS": 0,
    "REASSERT_INTERVAL_MS": 1000,
    "SEQ_IDLE_TTL_MS": 1000,
    "REDIS_MAX_CONNECTIONS": 2,
    "REDIS_TIMEOUT_MS": 100,
    "PUBLISH_CONCURRENCY": 1,
    "MAX_PUBLICATION_BYTES": 1024,
    "MAX_CADENCES_PER_FAMILY": 0,
    "MAX_TICKERS": 0,
    "MAX_CONNECTIONS_PER_USER": 0,
    "MAX_CONNECTIONS_PER_ADDRESS": 0,
    "PROBE_TOP_CHANNELS": 1,
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001 unknown keys, E002 bad numbers, E003 bad backplane, E004 bad backpressure policy."""
    from django.conf import settings

    messages: list[CheckMessage] = []
    user = getattr(settings, "REALTIME_APP", {}) or {}
    if not isinstance(user, dict):
        return [Error("REALTIME_APP must be a dict.", hint="See docs/configuration.md.", id="realtime_app.E001")]
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        messages.append(
            Error(
                f"REALTIME_APP has unknown keys: {', '.join(unknown)}.",
                hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                id="realtime_app.E001",
            )
        )
    config = get_config()
    for key, low in _INT_SETTINGS.items():
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            messages.append(
                Error(
                    f"REALTIME_APP[{key!r}] must be an int >= {low}, got {value!r}.",
                    hint="See docs/configuration.md for its unit and what 0 means.",
                    id="realtime_app.E002",
                )
            )
    backplane = config["BACKPLANE"]
    if backplane not in ("auto", "memory", "redis"):
        from django.utils.module_loading import import_string

        try:
            import_string(backplane)
        except ImportError:
            messages.append(
                Error(
                    f"REALTIME_APP['BACKPLANE'] is {backplane!r}: "
                    "not 'auto', 'memory', 'redis' or an importable class.",
                    id="realtime_app.E003",
                )
            )
    if config["BACKPRESSURE_POLICY"] not in ("drop", "close"):
        messages.append(
            Error(
                "REALTIME_APP['BACKPRESSURE_POLICY'] must be 'drop' or 'close', "
                f"got {config['BACKPRESSURE_POLICY']!r}.",
                id="realtime_app.E004",
            )
        )
    return messages


def _variant_samples(base: str) -> list[str]:
    fam = registry.families[base]
    values = {1, fam.bounds.min, fam.bounds.default + 1, fam.bounds.max, fam.bounds.max * 10, 999_999_999}
    return [f"{base}:{v}" for v in sorted(values)]


@register(Tags.security)
def check_policies(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E010 invalid rules; W010 duplicate patterns; W011 a cadence looser than its base;
    W012 a rule matching no registered channel; W013 client publishing on a state channel."""
    config = get_config()
    try:
        rules = compile_rules([*config["POLICIES"], *config["BUILTIN_POLICIES"]])
    except (ValueError, ImportError) as exc:
        return [
            Error(
                f"REALTIME_APP['POLICIES'] is invalid: {exc}", hint="See docs/configuration.md.", id="realtime_app.E010"
            )
        ]
    user_count = len(config["POLICIES"])
    messages: list[CheckMessage] = []
    seen: dict[str, Rule] = {}
    for rule in rules[:user_count]:
        if rule.pattern in seen:
            messages.append(
                Warning(
                    f"POLICIES[{rule.index}] repeats the pattern {rule.pattern!r} "
                    f"of POLICIES[{seen[rule.pattern].index}]; only the first applies.",
                    hint="Merge the two rules.",
                    id="realtime_app.W010",
                )
            )
        else:
            seen[rule.pattern] = rule
    for base in sorted(registry.families):
        base_rule = matching_rule(rules, base)
        base_strength = base_rule.subscribe.strength() if base_rule else (0,)
        for name in _variant_samples(base):
            variant = matching_rule(rules, name, base)
            strength = variant.subscribe.strength() if variant else (0,)
            if strength < base_strength:
                where = f"POLICIES[{variant.index}] ({variant.pattern!r})" if variant else "no rule"
                messages.append(
                    Warning(
                        f"{where} leaves {name!r} less guarded than its family base {base!r}.",
                        hint="A rule on the base guards every cadence; remove the looser rule or make it as strict.",
                        obj=base,
                        id="realtime_app.W011",
                    )
                )
                break
    candidates = [*registry.exact, *registry.families]
    candidates += [f"{b}:{f.bounds.min}" for b, f in registry.families.items()]
    if candidates:
        for rule in rules[:user_count]:
            if not any(rule.matches(name) for name in candidates):
                messages.append(
                    Warning(
                        f"POLICIES[{rule.index}] pattern {rule.pattern!r} matches no registered channel.",
                        hint="Check the spelling, or that the module registering it is imported.",
                        id="realtime_app.W012",
                    )
                )
    for rule in rules[:user_count]:
        if rule.publish.allowed:
            state = [n for n, s in registry.exact.items() if s.kind == "state" and rule.matches(n)]
            state += [b for b in registry.families if rule.matches(b)]
            if state and not any(rule.matches(n) for n, s in registry.exact.items() if s.kind == "event"):
                messages.append(
                    Warning(
                        f"POLICIES[{rule.index}] allows clients to publish on {rule.pattern!r}, which holds only "
                        "state channels; clients can publish on event channels only.",
                        id="realtime_app.W013",
                    )
                )
    return messages


#: Versions whose private transport internals realtime_app.transports was written against.
TESTED_SERVERS = {"daphne": ("4.2",), "autobahn": ("26.",), "twisted": ("26.",), "uvicorn": ("0.54",)}


@register(Tags.compatibility)
def check_server_versions(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W020: an installed server whose transport internals the guard was not tested against."""
    from importlib import metadata

    if get_config()["MAX_BACKPRESSURE"] == 0:
        return []
    messages: list[CheckMessage] = []
    for package, prefixes in TESTED_SERVERS.items():
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if not version.startswith(prefixes):
            messages.append(
                Warning(
                    f"{package} {version} is installed; transport backpressure reads its private internals and was "
                    f"tested with {package} {' / '.join(p.rstrip('.') + '.x' for p in prefixes)}.",
                    hint="Run realtime_app's transport tests against this version, or pin the tested one.",
                    id="realtime_app.W020",
                )
            )
    return messages
