from django.core.checks import Error, Warning
from django.test import override_settings

from realtime_app.checks import check_policies, check_settings


def ids(messages):
    return [m.id for m in messages]


def test_the_demo_configuration_is_clean():
    assert check_settings() == [] and check_policies() == []


@override_settings(REALTIME_APP={"MAX_FRAME_BYTE": 10})
def test_unknown_key():
    [message] = check_settings()
    assert message == Error(
        "REALTIME_APP has unknown keys: MAX_FRAME_BYTE.",
        hint=message.hint,
        id="realtime_app.E001",
    )
    assert "MAX_FRAME_BYTES" in message.hint


@override_settings(REALTIME_APP={"MAX_FRAME_BYTES": -1, "LEASE_TTL_MS": "3s", "MAX_BATCH": True})
def test_bad_numbers():
    assert ids(check_settings()) == ["realtime_app.E002"] * 3


@override_settings(REALTIME_APP={"BACKPLANE": "no.such.Backplane", "BACKPRESSURE_POLICY": "drop-oldest"})
def test_bad_backplane_and_policy():
    assert ids(check_settings()) == ["realtime_app.E003", "realtime_app.E004"]


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "demo:", "staf": True}]})
def test_invalid_rule():
    [message] = check_policies()
    assert message.id == "realtime_app.E010" and "POLICIES[0]" in message.msg and "staf" in message.msg


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "demo:clock"}, {"pattern": "demo:clock", "staff": True}]})
def test_duplicate_pattern():
    assert ids(check_policies()) == ["realtime_app.W010"]


@override_settings(
    REALTIME_APP={
        "POLICIES": [
            {"pattern": "atelier:load", "authenticated": True},
            {"pattern": "atelier:load:*", "authenticated": False},
        ]
    }
)
def test_a_cadence_rule_looser_than_its_base_is_flagged():
    [message] = check_policies()
    assert message == Warning(
        "POLICIES[1] ('atelier:load:*') leaves 'atelier:load:1' less guarded than its family base 'atelier:load'.",
        hint=message.hint,
        obj="atelier:load",
        id="realtime_app.W011",
    )


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "atelier:lod", "authenticated": True}]})
def test_a_pattern_matching_nothing_is_flagged():
    assert ids(check_policies()) == ["realtime_app.W012"]


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "demo:clock", "publish": True}]})
def test_publishing_on_state_channels_is_flagged():
    assert ids(check_policies()) == ["realtime_app.W013"]


def test_tested_server_versions_are_installed():
    from realtime_app.checks import check_server_versions

    assert check_server_versions() == []


def test_an_untested_server_version_is_flagged(monkeypatch):
    from importlib import metadata

    from realtime_app.checks import check_server_versions

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "5.0" if name == "daphne" else real(name))
    [message] = check_server_versions()
    assert message.id == "realtime_app.W020" and "daphne 5.0" in message.msg
