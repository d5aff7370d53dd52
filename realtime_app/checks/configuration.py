"""System checks: configuration errors at startup, not at the first frame (ids are stable,
listed in docs/checks.md)."""

from __future__ import annotations

import itertools
import os
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register

from realtime_app.checks.backplane import check_backplane, check_cluster, check_shards
from realtime_app.conf import DEFAULTS, chosen_backplane, get_config
from realtime_app.conf.typed import bounds
from realtime_app.declarations.coverage import cadences_matched, unmatched_rules
from realtime_app.declarations.policies import Rule, configured_rules, matching_rule
from realtime_app.declarations.registry import Family, registry

__all__ = ["check_channels", "check_layer", "check_policies", "check_server_versions", "check_settings"]


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
    for key, (kind, low, high) in bounds().items():  # declared beside each field (conf.typed)
        value = config[key]
        number = not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float))
        if not number or not low <= value < float("inf"):
            what = "an int" if kind is int else "a number"
            messages.append(
                Error(
                    f"REALTIME_APP[{key!r}] must be {what} >= {low}, got {value!r}.",
                    hint="See docs/configuration.md for its unit and what 0 means.",
                    id="realtime_app.E002",
                )
            )
        elif high is not None and value > high:
            messages.append(
                Error(f"REALTIME_APP[{key!r}] must be at most {high}, got {value!r}.", id="realtime_app.E002")
            )
    if config["HANDSHAKES_PER_S"] and not config["HANDSHAKE_BURST"]:
        messages.append(
            Error(
                "REALTIME_APP['HANDSHAKE_BURST'] must be >= 1 while HANDSHAKES_PER_S is on.",
                hint="HANDSHAKES_PER_S = 0 switches the handshake limit off.",
                id="realtime_app.E002",
            )
        )
    messages += _check_trusted_proxies(config["TRUSTED_PROXIES"])
    messages += _check_forwarded_header(config["FORWARDED_HEADER"])
    journal = config["WRITE_BEHIND_JOURNAL_DIR"]
    if journal is not None and not isinstance(journal, (str, os.PathLike)):
        messages.append(
            Error(
                f"REALTIME_APP['WRITE_BEHIND_JOURNAL_DIR'] must be a directory path or None, got {journal!r}.",
                hint="A directory that outlives a restart (docs/write-behind.md).",
                id="realtime_app.E002",
            )
        )
    messages += check_backplane(config["BACKPLANE"])
    messages += check_shards(config["REDIS_SHARDS"]) + check_cluster(config)
    capacity, refill = config["ADMISSION_BUCKET_CAPACITY"], config["ADMISSION_REFILL_PER_S"]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in (capacity, refill))
    if not numbers or (capacity and not refill):
        messages.append(
            Error(
                "REALTIME_APP['ADMISSION_BUCKET_CAPACITY'] and ['ADMISSION_REFILL_PER_S'] must be numbers >= 0, "
                f"and a bucket needs a refill; got {capacity!r} and {refill!r}.",
                hint="ADMISSION_BUCKET_CAPACITY = 0 switches the bucket off.",
                id="realtime_app.E006",
            )
        )
    messages += _check_json_encoder(config["JSON_ENCODER"])
    if not _callable_or_none(config["PRESENCE_INFO"]) or not isinstance(config["PRESENCE_LIST_ANONYMOUS"], bool):
        why = "PRESENCE_INFO must be None, a callable or its dotted path; PRESENCE_LIST_ANONYMOUS a bool"
        messages.append(Error(f"REALTIME_APP: {why}.", hint="See docs/presence.md.", id="realtime_app.E002"))
    if config["TOKEN_SALT"] is not None and not (isinstance(config["TOKEN_SALT"], str) and config["TOKEN_SALT"]):
        messages.append(Error("REALTIME_APP['TOKEN_SALT'] must be None or a non-empty string", id="realtime_app.E002"))
    for key in ("TOKEN_ORIGINS", "PUBLISH_API_KEYS"):  # lists of non-empty strings (a "" key would be no key)
        if not isinstance(config[key], (list, tuple)) or not all(isinstance(v, str) and v for v in config[key]):
            messages.append(Error(f"REALTIME_APP[{key!r}] must be a list of non-empty strings", id="realtime_app.E002"))
    if config["BACKPRESSURE_POLICY"] not in ("drop", "close"):
        messages.append(
            Error(
                "REALTIME_APP['BACKPRESSURE_POLICY'] must be 'drop' or 'close', "
                f"got {config['BACKPRESSURE_POLICY']!r}.",
                id="realtime_app.E004",
            )
        )
    return messages


def _callable_or_none(value: Any) -> bool:
    from django.utils.module_loading import import_string

    try:
        return value is None or callable(import_string(value) if isinstance(value, str) else value)
    except ImportError:
        return False


def _check_json_encoder(value: Any) -> list[CheckMessage]:
    """E009: JSON_ENCODER must name a json.JSONEncoder subclass."""
    import json

    from django.utils.module_loading import import_string

    try:
        cls = import_string(value) if isinstance(value, str) else value
    except ImportError as exc:
        cls, why = None, f" ({exc})"
    else:
        why = ""
    if isinstance(cls, type) and issubclass(cls, json.JSONEncoder):
        return []
    return [
        Error(
            f"REALTIME_APP['JSON_ENCODER'] must be the dotted path of a json.JSONEncoder subclass, got {value!r}{why}.",
            hint="The default, 'django.core.serializers.json.DjangoJSONEncoder', is the one JsonResponse uses.",
            id="realtime_app.E009",
        )
    ]


def _check_trusted_proxies(value: Any) -> list[CheckMessage]:
    """E007: TRUSTED_PROXIES must be a list of addresses or networks."""
    from realtime_app.endpoint.addresses import parse_networks

    problem = None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        problem = f"must be a list of addresses or networks, got {value!r}"
    else:
        try:
            parse_networks(value)
        except ValueError as exc:
            problem = str(exc)
    if problem is None:
        return []
    return [
        Error(
            f"REALTIME_APP['TRUSTED_PROXIES'] {problem}.",
            hint='e.g. ["127.0.0.1", "10.0.0.0/8"]: the reverse proxies in front of the server.',
            id="realtime_app.E007",
        )
    ]


def _check_forwarded_header(value: Any) -> list[CheckMessage]:
    """E007: FORWARDED_HEADER must name one header a proxy writes."""
    from realtime_app.endpoint.addresses import FORWARDED_HEADERS

    if isinstance(value, str) and value.lower() in {h.lower() for h in FORWARDED_HEADERS}:
        return []
    return [
        Error(
            f"REALTIME_APP['FORWARDED_HEADER'] must be one of {', '.join(FORWARDED_HEADERS)}, got {value!r}.",
            hint="The header your proxy writes (and overwrites when a client sends it): docs/deployment.md.",
            id="realtime_app.E007",
        )
    ]


def _loosened_cadence(rules: list[Rule], rule: Rule, fam: Family) -> str | None:
    """A cadence of ``fam`` where ``rule`` wins over the family's rule and asks less."""
    family_rule = matching_rule(rules, fam.base)
    if family_rule is None or rule is family_rule or rule.subscribe.implies(family_rule.subscribe):
        return None
    for name in itertools.islice(cadences_matched(rule, fam), 5000):
        if matching_rule(rules, name, fam.base) is rule:
            return name
    return None


@register(Tags.security)
def check_policies(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E010 invalid rules; W010 duplicate patterns; W011 a rule on cadences looser than its
    family's rule; E015 a rule matching no declared channel; W013 client publishing on a
    state channel."""
    config = get_config()
    try:
        rules = configured_rules(config)
    except (ValueError, ImportError, TypeError) as exc:
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
    for rule in rules[:user_count]:
        if rule.override_family:
            continue  # opened on purpose
        for base, fam in sorted(registry.families.items()):
            name = _loosened_cadence(rules, rule, fam)
            if name is not None:
                family_rule = matching_rule(rules, base)
                assert family_rule is not None
                messages.append(
                    Warning(
                        f"POLICIES[{rule.index}] ({rule.pattern!r}) asks less than the rule of family {base!r} "
                        f"(POLICIES[{family_rule.index}], {family_rule.pattern!r}) for cadences such as {name!r}; "
                        "the family's rule applies to them as well.",
                        hint="A rule on a family guards every cadence. To open some cadences wider on purpose, "
                        'add "override_family": True to this rule; otherwise make it as strict or remove it.',
                        obj=base,
                        id="realtime_app.W011",
                    )
                )
    for rule, hint, certain in unmatched_rules(rules[:user_count], registry):
        if certain:  # no declared name even begins so: a typo, or a module never imported
            messages.append(
                Error(
                    f"POLICIES[{rule.index}] pattern {rule.pattern!r} matches no declared channel or template: it "
                    "guards nothing, and a channel template it was meant for stays closed to every client.",
                    hint=hint,
                    obj=rule.pattern,
                    id="realtime_app.E015",
                )
            )
        else:
            messages.append(
                Warning(
                    f"POLICIES[{rule.index}] pattern {rule.pattern!r} matches none of the declared channels, nor "
                    "the sample names of their templates.",
                    hint=hint,
                    obj=rule.pattern,
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
        if rule.backpressure == "conflate":
            events = sorted(n for n, s in registry.exact.items() if s.kind == "event" and rule.matches(n))
            if events:
                messages.append(
                    Warning(
                        f"POLICIES[{rule.index}] conflates {rule.pattern!r}, which matches event channels "
                        f"({', '.join(events[:5])}): they are never conflated (every message counts; a channel "
                        "with history resumes instead).",
                        hint="Conflate state channels: narrow the pattern, or drop the key for event channels.",
                        id="realtime_app.W014",
                    )
                )
    return messages


@register(Tags.compatibility)
def check_channels(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Two declarations that claim one name (a template and a listed channel, two
    templates, a template and a family's cadence): which one serves it is unknowable."""
    return [
        Error(
            f"channels {first!r} and {second!r} both match {name!r}.",
            hint="Give one of them a literal part of its own (e.g. 'room:<slug:name>' and 'room-id:<int:id>'), "
            "or a converter that cannot match what the other does.",
            obj=first,
            id="realtime_app.E013",
        )
        for first, second, name in registry.collisions()
    ]


#: Versions whose private transport internals realtime_app.outbound.transports was written against.
@register(Tags.compatibility)
def check_server_versions(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W020: an installed server whose transport internals were not tested. Whatever
    ``MAX_BACKPRESSURE`` says: the transport also writes frames, pauses reading and closes."""
    from realtime_app.outbound import daphne, uvicorn

    return [
        Warning(
            f"{found} is installed; realtime_app's transport reads its private internals and was tested with "
            f"{', '.join(p + '.x' for series in (*daphne.TESTED.values(), *uvicorn.TESTED.values()) for p in series)}"
            " (daphne, autobahn, Twisted, uvicorn). On daphne, frames then go through autobahn's public API.",
            hint="Run realtime_app's transport tests against this version, or pin the tested one.",
            id="realtime_app.W020",
        )
        for found in [*daphne.untested(), *uvicorn.untested()]
    ]


@register(Tags.compatibility)
def check_layer(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E008: ``BACKPLANE = "auto"`` with a channel layer the cluster cannot be carried on."""
    from django.conf import settings

    from realtime_app.cluster.hosts import REDIS_LAYERS, layer_kind

    if chosen_backplane(get_config(), layer_kind()) != "unsupported_layer":
        return []
    backend = settings.CHANNEL_LAYERS["default"]["BACKEND"]
    return [
        Error(
            f"The default channel layer is {backend}: realtime_app carries a cluster on the Redis of "
            f"{' or '.join(REDIS_LAYERS)}, and runs one process on channels.layers.InMemoryChannelLayer; "
            "with another layer, BACKPLANE='auto' would silently keep every process to itself.",
            hint="Use one of those layers, or set REALTIME_APP['BACKPLANE'] to 'memory' (one process), "
            "'redis' (with REDIS_URL) or the dotted path of a Backplane subclass.",
            id="realtime_app.E008",
        )
    ]


@register(Tags.compatibility)
def check_method_costs(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W030: a method that costs more than a full bucket holds is refused every time."""
    from realtime_app.endpoint.methods import method_costs

    capacity = get_config()["ADMISSION_BUCKET_CAPACITY"]
    if not isinstance(capacity, (int, float)) or isinstance(capacity, bool) or not capacity:
        return []
    costs = method_costs()
    return [
        Warning(
            f"RPC method {name!r} costs {cost:g} tokens, more than ADMISSION_BUCKET_CAPACITY ({capacity:g}): "
            "every call is refused with rate_limited.",
            hint="Lower its cost or raise ADMISSION_BUCKET_CAPACITY.",
            id="realtime_app.W030",
        )
        for name, cost in sorted(costs.items())
        if cost > capacity
    ]


_POOL_KEYS = {"max_concurrent": 1, "max_waiting": 0, "wait_timeout_ms": 1}


@register(Tags.compatibility)
def check_http_pools(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E020 an impossible HTTP pool; E021 a view's pool not configured; W031 no middleware."""
    from django.conf import settings

    pools = get_config()["HTTP_POOLS"]
    if not isinstance(pools, dict):
        return [Error("REALTIME_APP['HTTP_POOLS'] must be a dict of pool name -> options.", id="realtime_app.E020")]
    messages: list[CheckMessage] = []
    for name, options in pools.items():
        problems = _pool_problems(options)
        messages += [
            Error(
                f"REALTIME_APP['HTTP_POOLS'][{name!r}]: {problem}.",
                hint="See docs/http-limiter.md.",
                id="realtime_app.E020",
            )
            for problem in problems
        ]
    from realtime_app.inbound.pools import decorated_pools

    try:  # the URLconf imports the views: their decorators name their pools
        from django.urls import get_resolver

        get_resolver().url_patterns  # noqa: B018
    except Exception:  # reported by Django's own URL checks
        pass
    for name in sorted(decorated_pools - set(pools)):
        messages.append(
            Error(
                f"a view is decorated with @concurrency_limit({name!r}) "
                "but REALTIME_APP['HTTP_POOLS'] has no such pool.",
                hint="Add the pool, or fix the name.",
                id="realtime_app.E021",
            )
        )
    middleware = "realtime_app.middleware.ConcurrencyLimitMiddleware"
    if (pools or decorated_pools) and middleware not in getattr(settings, "MIDDLEWARE", []):
        messages.append(
            Warning(
                "HTTP pools are configured but ConcurrencyLimitMiddleware is not in MIDDLEWARE: nothing is limited.",
                hint=f"Add {middleware!r} to MIDDLEWARE, after the authentication middleware.",
                id="realtime_app.W031",
            )
        )
    return messages


def _pool_problems(options: Any) -> list[str]:
    if not isinstance(options, dict):
        return ["options must be a dict"]
    problems = [f"unknown key {key!r}" for key in sorted(set(options) - {*_POOL_KEYS, "paths"})]
    if "max_concurrent" not in options:
        problems.append("max_concurrent is required")
    for key, low in _POOL_KEYS.items():
        value = options.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            problems.append(f"{key} must be an int >= {low}, got {value!r}")
    paths = options.get("paths", [])
    if isinstance(paths, str) or not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
        problems.append("paths must be a list of path globs ('/reports/*')")
    return problems
