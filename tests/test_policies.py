from types import SimpleNamespace

import pytest

from realtime_app.declarations.policies import compile_rules, evaluate, matching_rule, requirement_for

ANON = SimpleNamespace(is_authenticated=False, is_active=False, is_staff=False, is_superuser=False)
USER = SimpleNamespace(is_authenticated=True, is_active=True, is_staff=False, is_superuser=False)
STAFF = SimpleNamespace(is_authenticated=True, is_active=True, is_staff=True, is_superuser=False)


def may(rules, user, name, base=None, action="subscribe"):
    return evaluate(requirement_for(rules, name, base, action), user, name, action)


def test_segment_prefix_guards_every_cadence_of_a_family():
    rules = compile_rules([{"pattern": "atelier:load", "authenticated": True}])
    for name in ["atelier:load", "atelier:load:250", "atelier:load:2000", "atelier:load:10", "atelier:load:60000"]:
        assert not may(rules, ANON, name, "atelier:load")
        assert may(rules, USER, name, "atelier:load")
    assert may(rules, ANON, "atelier:loader")  # a different channel


def test_prefix_with_colon_and_glob():
    rules = compile_rules([{"pattern": "atelier:", "authenticated": True}, {"pattern": "demo:*", "staff": True}])
    assert not may(rules, ANON, "atelier:anything:1")
    assert not may(rules, USER, "demo:clock")
    assert may(rules, STAFF, "demo:clock")


def test_glob_on_the_base_still_guards_the_cadences():
    rules = compile_rules([{"pattern": "atelier:loa?", "authenticated": True}])
    assert not may(rules, ANON, "atelier:load:2000", "atelier:load")


def test_most_specific_rule_wins():
    rules = compile_rules(
        [
            {"pattern": "demo:", "authenticated": True},
            {"pattern": "demo:clock", "authenticated": False},
            {"pattern": "demo:clock:5000", "staff": True},
        ]
    )
    assert not may(rules, ANON, "demo:other")
    assert may(rules, ANON, "demo:clock:2000", "demo:clock")
    assert not may(rules, USER, "demo:clock:5000", "demo:clock")
    assert matching_rule(rules, "demo:clock:5000", "demo:clock").pattern == "demo:clock:5000"


def test_publish_is_denied_unless_a_rule_allows_it():
    rules = compile_rules([{"pattern": "demo:events", "publish": {"authenticated": True}}])
    assert not may(rules, ANON, "demo:events", action="publish")
    assert may(rules, USER, "demo:events", action="publish")
    assert not may(rules, USER, "other:events", action="publish")
    assert may(rules, ANON, "demo:events")  # subscribing stays open
    assert may(compile_rules([{"pattern": "x", "publish": True}]), ANON, "x", action="publish")
    assert not may(compile_rules([{"pattern": "x", "subscribe": False}]), STAFF, "x")


def test_permissions_and_callables():
    class U(SimpleNamespace):
        def has_perms(self, perms):
            return set(perms) <= self.perms

    user = U(is_authenticated=True, is_active=True, is_staff=False, is_superuser=False, perms={"app.view"})
    rules = compile_rules([{"pattern": "p", "permission": "app.view"}, {"pattern": "q", "permission": ["app.edit"]}])
    assert may(rules, user, "p") and not may(rules, user, "q")
    calls = []
    rules = compile_rules([{"pattern": "c", "check": lambda u, ch, a: calls.append((ch, a)) or ch.endswith("ok")}])
    assert not may(rules, user, "c:no") and may(rules, user, "c:ok")
    assert calls == [("c:no", "subscribe"), ("c:ok", "subscribe")]


@pytest.mark.parametrize(
    "raw",
    [
        ["not a dict"],
        [{"authenticated": True}],
        [{"pattern": ""}],
        [{"pattern": "a", "authenticaded": True}],
        [{"pattern": "a", "staff": "yes"}],
        [{"pattern": "a", "permission": [1]}],
        [{"pattern": "a", "check": 5}],
        [{"pattern": "a", "publish": "everyone"}],
    ],
)
def test_invalid_rules_are_refused_with_their_index(raw):
    with pytest.raises(ValueError, match=r"POLICIES\[0\]"):
        compile_rules(raw)


@pytest.mark.parametrize("pattern", ["atelier:load:2000", "atelier:load:*", "atelier:load:2?00", "atelier:load:[2]000"])
def test_a_rule_on_a_cadence_cannot_open_a_guarded_family(pattern):
    """Found: a rule opening atelier:load:2000 beside a guarded atelier:load let anonymous in."""
    rules = compile_rules([{"pattern": "atelier:load", "authenticated": True}, {"pattern": pattern, "subscribe": True}])
    assert not may(rules, ANON, "atelier:load:2000", "atelier:load")
    assert may(rules, USER, "atelier:load:2000", "atelier:load")


def test_a_cadence_rule_adds_to_the_family_rule():
    rules = compile_rules(
        [{"pattern": "atelier:load", "authenticated": True}, {"pattern": "atelier:load:2000", "staff": True}]
    )
    assert not may(rules, USER, "atelier:load:2000", "atelier:load") and may(
        rules, STAFF, "atelier:load:2000", "atelier:load"
    )


def test_override_family_opens_a_cadence_on_purpose():
    rules = compile_rules(
        [
            {"pattern": "atelier:load", "authenticated": True},
            {"pattern": "atelier:load:60000", "subscribe": True, "override_family": True},
        ]
    )
    assert may(rules, ANON, "atelier:load:60000", "atelier:load")
    assert not may(rules, ANON, "atelier:load:2000", "atelier:load")
    with pytest.raises(ValueError, match="override_family"):
        compile_rules([{"pattern": "x", "override_family": "yes"}])


def test_a_bracket_expression_is_not_literal_text_when_ranking_rules():
    """Found in review: ``*:[1-9][0-9][0-9][0-9]`` with override_family counted its
    brackets as literal characters and outranked the built-in staff rule of the health channel."""
    rules = compile_rules(
        [
            {"pattern": "*:[1-9][0-9][0-9][0-9]", "subscribe": True, "override_family": True},
            {"pattern": "realtime:socket", "staff": True},
        ]
    )
    assert rules[0].literal_length() == 1  # only the ":"
    assert not may(rules, ANON, "realtime:socket:5000", "realtime:socket")


def test_a_rule_chooses_its_channels_backpressure_and_event_channels_are_never_conflated():
    from django.core.checks import run_checks
    from django.test import override_settings

    from realtime_app.declarations.policies import frame_policy

    rules = [
        {"pattern": "demo:", "backpressure": "drop"},
        {"pattern": "demo:clock", "backpressure": "conflate"},
        {"pattern": "demo:events", "backpressure": "conflate"},
        {"pattern": "atelier:", "authenticated": True},  # sets none: the global policy
    ]
    with override_settings(REALTIME_APP={"POLICIES": rules}):
        assert frame_policy("demo:clock:250") == "conflate"  # a cadence of the family
        assert frame_policy("demo:events") is None  # an event channel: never conflated
        assert frame_policy("demo:flood:100") == "drop"
        assert frame_policy("atelier:load") is None
        [warning] = [m for m in run_checks() if m.id == "realtime_app.W014"]
        assert "demo:events" in warning.msg
    with override_settings(REALTIME_APP={"POLICIES": [{"pattern": "demo:", "backpressure": "later"}]}):
        [error] = [m for m in run_checks() if m.id == "realtime_app.E010"]
        assert "'backpressure' must be one of ['drop', 'close', 'conflate']" in error.msg


def test_presence_follows_the_subscribe_rule_unless_a_rule_says_otherwise():

    rules = compile_rules(
        [
            {"pattern": "room:", "authenticated": True},
            {"pattern": "stage:", "presence": {"staff": True}},
        ]
    )
    assert requirement_for(rules, "room:a", None, "presence").authenticated  # as subscribe
    stage = requirement_for(rules, "stage:a", None, "presence")
    assert stage.staff and not requirement_for(rules, "stage:a", None, "subscribe").staff
    assert requirement_for(rules, "elsewhere", None, "presence").allowed  # no rule: as subscribe
    with pytest.raises(ValueError, match="presence"):
        compile_rules([{"pattern": "x:", "presence": {"stafff": True}}])
