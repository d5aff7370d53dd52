"""Channel templates: Django's converters in channel names, what an instance resolves to,
the cadence suffix kept unambiguous, collisions refused by a system check, and policy
rules that match templates and read ``channel.params``."""

from __future__ import annotations

import uuid

import pytest
from django.urls import register_converter

from realtime_app import ChannelName, ConfigurationError
from realtime_app.checks.configuration import check_channels
from realtime_app.declarations.policies import compile_rules, matching_rule
from realtime_app.declarations.registry import Registry
from realtime_app.declarations.templates import compile_template
from realtime_app.wire.history import HistoryPolicy


class FourDigits:
    regex = "[0-9]{4}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return f"{value:04d}"


class Anything:
    regex = ".+"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(FourDigits, "yyyy")
register_converter(Anything, "anything")


def test_each_converter_converts_as_in_a_url():
    assert compile_template("bids:<int:lot>").match("bids:42") == {"lot": 42}
    assert compile_template("room:<slug:name>").match("room:the-lobby_2") == {"name": "the-lobby_2"}
    key = uuid.UUID("12345678-1234-4678-9234-567812345678")
    assert compile_template("doc:<uuid:key>").match(f"doc:{key}") == {"key": key}
    assert compile_template("year:<yyyy:y>:<int:n>").match("year:2026:7") == {"y": 2026, "n": 7}
    assert compile_template("t:<name>").match("t:hello world") == {"name": "hello world"}  # str by default


def test_a_name_that_is_not_an_instance_does_not_match():
    bids = compile_template("bids:<int:lot>")
    for name in ("bids:x", "bids:", "bids:42:x", "bids:-1", "xbids:42", "bids:42 "):
        assert bids.match(name) is None, name


def test_str_never_spans_a_colon_and_converters_that_could_are_refused():
    assert compile_template("t:<str:name>").match("t:a:b") is None
    with pytest.raises(ConfigurationError, match="matches ':'"):
        compile_template("t:<path:rest>")
    with pytest.raises(ConfigurationError, match="matches ':'"):
        compile_template("t:<anything:rest>")


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("t:<nope:x>", "unknown converter 'nope'"),
        ("t:<int:x>:<slug:x>", "appears twice"),
        ("t:<int:1x>", "not an identifier"),
        ("t:<int:x", "unbalanced"),
        ("t:<x>>", "unbalanced"),
        ("t:x", "declares no parameter"),
    ],
)
def test_a_malformed_template_is_refused_with_what_is_wrong(pattern, problem):
    with pytest.raises(ConfigurationError, match=problem):
        compile_template(pattern)


def test_an_instance_resolves_with_its_params_and_its_own_history():
    registry = Registry()
    registry.add_channel("bids:<int:lot>", "event", history=HistoryPolicy(100, 300))
    spec = registry.resolve("bids:42")
    assert (spec.name, spec.kind, spec.params, spec.template) == ("bids:42", "event", {"lot": 42}, "bids:<int:lot>")
    assert spec.history == HistoryPolicy(100, 300)
    assert registry.resolve("bids:7").name == "bids:7"


def test_the_cadence_suffix_of_a_cadenced_template_is_unambiguous():
    registry = Registry()
    registry.add_family("lot:<int:id>", None, default=1000, min=100, max=10000, fed=HistoryPolicy(1, 60))
    at_2000 = registry.resolve("lot:42:2000")
    assert (at_2000.name, at_2000.base, at_2000.interval_ms, at_2000.params) == (
        "lot:42:2000",
        "lot:42",
        2000,
        {"id": 42},
    )
    default = registry.resolve("lot:17")  # instance 17 at the default cadence, not a cadence 17
    assert (default.name, default.base, default.interval_ms, default.params) == ("lot:17", "lot:17", 1000, {"id": 17})
    assert registry.resolve("lot:17:1000").name == "lot:17"  # the default cadence is named by the base
    assert registry.resolve("lot:17:5").interval_ms == 100  # clamped like any family's
    assert registry.family_of("lot:42:250").base == "lot:42"
    assert registry.find("lot:42:x") is None and registry.find("lot:x") is None


def test_a_ticker_template_has_literal_text_after_its_parameter():
    registry = Registry()
    registry.add_family("room:<slug:name>:load", lambda channel, publish: None, default=1000, min=100, max=60000)
    spec = registry.resolve("room:lobby:load:250")
    assert (spec.base, spec.interval_ms, spec.params, spec.has_ticker) == (
        "room:lobby:load",
        250,
        {"name": "lobby"},
        True,
    )
    assert registry.find("room:lobby") is None


def test_instance_options_belong_to_templates():
    registry = Registry()
    with pytest.raises(ConfigurationError, match="apply to channel templates"):
        registry.add_channel("plain", "event", exists=lambda params: True)
    with pytest.raises(ConfigurationError, match="owner 'user' is none of its parameters"):
        registry.add_channel("feed:<int:id>", "event", owner="user")
    with pytest.raises(ConfigurationError, match="reserved|cluster's own"):
        registry.add_channel("realtime.fed:x", "event")


def test_declarations_that_claim_one_name_are_each_named():
    registry = Registry()
    registry.add_channel("room:<slug:name>", "event")
    registry.add_channel("room:<int:id>", "event")  # room:1 is both
    registry.add_channel("room:lobby", "event")  # and the slug claims the listed room
    registry.add_family("lot", lambda channel, publish: None, default=1000, min=100, max=10000)
    registry.add_channel("lot:<int:id>", "event")  # lot:2000 would be a cadence of the family lot
    registry.add_channel("bids:<int:lot>", "event")  # alone: fine
    pairs = {(first, second) for first, second, _ in registry.collisions()}
    assert pairs == {
        ("room:lobby", "room:<slug:name>"),
        ("lot", "lot:<int:id>"),
        ("room:<slug:name>", "room:<int:id>"),
    }


def test_the_system_check_reports_a_collision(monkeypatch):
    from realtime_app.declarations import registry as module

    registry = Registry()
    registry.add_channel("room:<slug:name>", "event")
    registry.add_channel("room:<int:id>", "event")
    monkeypatch.setattr(module, "registry", registry)
    monkeypatch.setattr("realtime_app.checks.configuration.registry", registry)
    [error] = check_channels()
    assert error.id == "realtime_app.E013" and "'room:<slug:name>'" in error.msg and "'room:<int:id>'" in error.msg


def test_the_demo_and_test_channels_do_not_collide():
    assert check_channels() == []


def test_a_rule_on_a_template_matches_its_instances_and_their_cadences():
    [rule] = compile_rules([{"pattern": "lot:<int:id>", "authenticated": True}])
    assert rule.matches("lot:42") and rule.matches("lot:42:250")
    assert not rule.matches("lot:x") and not rule.matches("lots:42")
    rules = compile_rules([{"pattern": "lot:", "staff": True}, {"pattern": "lot:<int:id>", "authenticated": True}])
    assert matching_rule(rules, "lot:42").pattern == "lot:<int:id>"  # as literal as the prefix, and names instances
    assert matching_rule(rules, "lot:x").pattern == "lot:"
    with pytest.raises(ValueError, match=r"POLICIES\[0\].*unknown converter"):
        compile_rules([{"pattern": "lot:<nope:id>"}])


def test_a_channel_name_is_a_string_with_its_params():
    name = ChannelName("lot:42", {"id": 42}, "lot:<int:id>")
    assert (
        name == "lot:42" and name.startswith("lot:") and name.params == {"id": 42} and name.template == "lot:<int:id>"
    )


def test_one_object_is_one_channel_whatever_the_spelling():
    registry = Registry()
    registry.add_channel("bids:<int:lot>", "event")
    registry.add_family("lot:<int:id>", None, default=1000, min=100, max=10000, fed=HistoryPolicy(1, 60))
    registry.add_channel("doc:<uuid:key>", "event")
    assert registry.resolve("bids:0042").name == "bids:42"
    assert (registry.resolve("lot:007:250").name, registry.resolve("lot:007").name) == ("lot:7:250", "lot:7")
    assert registry.resolve("lot:007:250").base == "lot:7" and registry.family_of("lot:007:250").base == "lot:7"
    assert registry.find("doc:12345678-1234-4678-9234-56781234567A") is None  # Django's uuid: lower case only
