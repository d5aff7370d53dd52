import pytest
from django.core.checks import Error
from django.test import override_settings

from realtime_app.checks.configuration import check_policies, check_settings


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


@pytest.mark.parametrize(
    "presence",
    [
        {"PRESENCE_INFO": "no.such.hook"},
        {"PRESENCE_INFO": 42},
        {"PRESENCE_LIST_ANONYMOUS": "yes"},
        {"PRESENCE_INTERVAL_MS": 10},
        {"PRESENCE_DIFF_MEMBERS": -1},
    ],
)
def test_bad_presence_settings(presence):
    with override_settings(REALTIME_APP=presence):
        assert ids(check_settings()) == ["realtime_app.E002"]


@override_settings(REALTIME_APP={"PRESENCE_INFO": "tests.testapp.realtime_channels.presence_info"})
def test_a_presence_info_hook_by_dotted_path_is_fine():
    assert check_settings() == []


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


GUARDED = {"pattern": "atelier:load", "authenticated": True}


@pytest.mark.parametrize(
    ("pattern", "example"),
    [
        ("atelier:load:2000", "atelier:load:2000"),  # an exact cadence
        ("atelier:load:*", "atelier:load:250"),  # a glob over every cadence
        ("atelier:load:2?00", "atelier:load:2000"),
        ("atelier:load:[45]000", "atelier:load:4000"),
        ("atelier:load:", "atelier:load:250"),  # a prefix of the cadences only
    ],
)
def test_a_rule_asking_less_for_cadences_of_a_guarded_family_is_flagged(pattern, example):
    with override_settings(REALTIME_APP={"POLICIES": [GUARDED, {"pattern": pattern, "subscribe": True}]}):
        [message] = check_policies()
    assert message.id == "realtime_app.W011" and message.obj == "atelier:load"
    assert f"POLICIES[1] ({pattern!r})" in message.msg and repr(example) in message.msg
    assert "override_family" in message.hint


@pytest.mark.parametrize(
    "rule",
    [
        {"pattern": "atelier:load:2000", "staff": True},  # stricter: fine
        {"pattern": "atelier:load:2000", "subscribe": True, "override_family": True},  # opened on purpose
        {"pattern": "atelier:load:10"},  # below the bounds: matches no canonical name (W012 instead)
    ],
)
def test_stricter_or_opted_in_cadence_rules_are_not_flagged(rule):
    with override_settings(REALTIME_APP={"POLICIES": [GUARDED, rule]}):
        assert "realtime_app.W011" not in ids(check_policies())


def test_a_rule_on_the_default_cadence_name_matches_nothing_and_says_why():
    rules = [GUARDED, {"pattern": "atelier:load:1000", "subscribe": True}]
    with override_settings(REALTIME_APP={"POLICIES": rules}):
        [message] = check_policies()
    assert message.id == "realtime_app.E015" and "default cadence" in message.hint


def test_a_rule_on_a_cadence_of_a_registered_family_is_not_unknown():
    with override_settings(REALTIME_APP={"POLICIES": [{"pattern": "atelier:load:2000", "staff": True}]}):
        assert check_policies() == []


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "atelier:[load", "authenticated": True}]})
def test_an_unbalanced_glob_is_an_error():
    [message] = check_policies()
    assert message.id == "realtime_app.E010" and "'['" in message.msg


@override_settings(REALTIME_APP=["not", "a", "dict"])
def test_a_realtime_app_that_is_not_a_dict_is_an_error_not_a_crash():
    from django.apps import apps

    apps.get_app_config("realtime_app").ready()  # no TypeError
    assert ids(check_settings()) == ["realtime_app.E001"]
    assert check_policies() == []


@override_settings(REALTIME_APP={"BACKPLANE": "redis"})
def test_the_redis_backplane_without_the_redis_layer_is_an_error():
    assert ids(check_settings()) == ["realtime_app.E005"]


@pytest.mark.parametrize(
    "shards",
    [
        [],
        "redis://a:6379/0",
        [1, 2],
        [{"no": "address"}],
        ["redis://a:6379/0", "http://b:6379/0"],
        ["redis://a:6379/0", "redis://a:6379/0"],
        ["redis://a:6379/0", "redis://a:6379"],  # one server, spelt two ways (found: accepted)
        ["redis://A:6379/0", {"address": "redis://a/0"}],
        [("a", 6379), "redis://a:6379/0"],
    ],
)
def test_redis_shards_that_are_no_hosts_are_an_error(settings, shards):
    settings.REALTIME_APP = {"REDIS_SHARDS": shards}
    [message] = check_settings()
    assert message.id == "realtime_app.E011" and "REDIS_SHARDS" in message.msg


def test_redis_shards_on_other_databases_or_ports_are_other_servers(settings):
    settings.REALTIME_APP = {"REDIS_SHARDS": ["redis://a:6379/0", "redis://a:6379/1", "redis://a:6380/0"]}
    assert check_settings() == []


def test_several_redis_servers_make_a_sharded_backplane(settings):
    from realtime_app.cluster.factory import backplane_class
    from realtime_app.cluster.redis import RedisBackplane
    from realtime_app.cluster.shards import ShardedBackplane

    settings.REALTIME_APP = {"REDIS_SHARDS": ["redis://127.0.0.1:1/0", "redis://:secret@127.0.0.1:2/3"]}
    assert check_settings() == [] and backplane_class() is ShardedBackplane
    backplane = ShardedBackplane(config={**settings.REALTIME_APP, "KEY_PREFIX": "x"})
    assert [s["address"] for s in backplane.shards_probe()] == ["127.0.0.1:1/0", "127.0.0.1:2/3"]  # no password
    settings.REALTIME_APP = {"REDIS_SHARDS": ["redis://127.0.0.1:1/0"]}
    assert backplane_class() is RedisBackplane  # one server: no router


@override_settings(REALTIME_APP={"BACKPLANE": "realtime_app.conf.get_config"})
def test_a_backplane_path_that_is_not_a_backplane_is_an_error():
    assert ids(check_settings()) == ["realtime_app.E003"]


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "atelier:lod", "authenticated": True}]})
def test_a_pattern_matching_nothing_is_flagged():
    assert ids(check_policies()) == ["realtime_app.E015"]


@override_settings(REALTIME_APP={"POLICIES": [{"pattern": "demo:clock", "publish": True}]})
def test_publishing_on_state_channels_is_flagged():
    assert ids(check_policies()) == ["realtime_app.W013"]


def test_tested_server_versions_are_installed():
    from realtime_app.checks.configuration import check_server_versions

    assert check_server_versions() == []


def test_an_untested_server_version_is_flagged(monkeypatch):
    from importlib import metadata

    from realtime_app.checks.configuration import check_server_versions

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "5.0" if name == "daphne" else real(name))
    [message] = check_server_versions()
    assert message.id == "realtime_app.W020" and "daphne 5.0" in message.msg
    with override_settings(REALTIME_APP={"MAX_BACKPRESSURE": 0}):  # the transport is used all the same
        [message] = check_server_versions()
    assert message.id == "realtime_app.W020"


REDIS_LAYER = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://x"]}}}


PUBSUB_LAYER = {
    "default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": ["redis://x"]}}
}


@pytest.mark.parametrize("layers", [REDIS_LAYER, PUBSUB_LAYER])
def test_both_channels_redis_layers_carry_the_cluster(layers):
    """Found: with RedisPubSubChannelLayer, "auto" picked the in-memory backplane: every
    process kept to itself (two tickers per cadence) and check said nothing."""
    from realtime_app.checks.configuration import check_layer
    from realtime_app.cluster.factory import backplane_class
    from realtime_app.cluster.redis import RedisBackplane

    with override_settings(CHANNEL_LAYERS=layers):
        assert backplane_class() is RedisBackplane
        assert check_layer() == []


@pytest.mark.parametrize("named", [{"REDIS_URL": "redis://127.0.0.1:1/0"}, {"REDIS_SHARDS": ["redis://127.0.0.1:1/0"]}])
def test_a_redis_named_in_the_settings_chooses_redis_whatever_the_layer(named):
    """Found: with ``BACKPLANE="auto"``, ``REDIS_SHARDS`` chose Redis but ``REDIS_URL`` did
    not (one process each, two tickers per cadence); the rule now lives in one place."""
    from realtime_app.checks.configuration import check_layer
    from realtime_app.cluster.factory import backplane_class
    from realtime_app.cluster.redis import RedisBackplane

    for layers in ({"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}, {}):
        with override_settings(CHANNEL_LAYERS=layers, REALTIME_APP=named):
            assert backplane_class() is RedisBackplane and check_layer() == []
    with override_settings(CHANNEL_LAYERS={"default": {"BACKEND": "somewhere.else.RabbitLayer"}}, REALTIME_APP=named):
        assert backplane_class() is RedisBackplane and check_layer() == []  # chosen: not one process


def test_a_layer_the_cluster_cannot_be_carried_on_is_an_error_not_one_process():
    from django.core.exceptions import ImproperlyConfigured

    from realtime_app.checks.configuration import check_layer
    from realtime_app.cluster.factory import backplane_class

    other = {"default": {"BACKEND": "somewhere.else.RabbitLayer"}}
    with override_settings(CHANNEL_LAYERS=other):
        [message] = check_layer()
        assert message.id == "realtime_app.E008" and "somewhere.else.RabbitLayer" in message.msg
        with pytest.raises(ImproperlyConfigured):
            backplane_class()
    with override_settings(CHANNEL_LAYERS=other, REALTIME_APP={"BACKPLANE": "memory"}):
        assert check_layer() == []  # chosen on purpose
    assert check_layer() == []  # the in-memory layer of the tests: one process


@pytest.mark.parametrize(
    "values", [{"ADMISSION_BUCKET_CAPACITY": 10, "ADMISSION_REFILL_PER_S": 0}, {"ADMISSION_BUCKET_CAPACITY": "18"}]
)
def test_an_impossible_bucket_is_an_error(values):
    with override_settings(REALTIME_APP=values):
        assert ids(check_settings()) == ["realtime_app.E006"]


def test_a_method_costing_more_than_the_bucket_is_a_warning():
    from realtime_app.checks.configuration import check_method_costs

    assert ids(check_method_costs()) == []  # test.costly costs 6 of 18
    with override_settings(REALTIME_APP={"ADMISSION_BUCKET_CAPACITY": 5.0}):
        messages = check_method_costs()
    assert ids(messages) == ["realtime_app.W030"] and "'test.costly' costs 6" in messages[0].msg
    with override_settings(REALTIME_APP={"ADMISSION_BUCKET_CAPACITY": 0}):
        assert check_method_costs() == []  # no bucket: nothing is refused for its cost


@pytest.mark.parametrize(
    "pool, problem",
    [
        ({"max_concurrent": 0}, "max_concurrent must be an int >= 1"),
        ({}, "max_concurrent is required"),
        ({"max_concurrent": 2, "max_waiting": -1}, "max_waiting must be an int >= 0"),
        ({"max_concurrent": 2, "wait_timeout_ms": 0}, "wait_timeout_ms must be an int >= 1"),
        ({"max_concurrent": 2, "paths": "/reports/*"}, "paths must be a list"),
        ({"max_concurrent": 2, "max_concurent": 3}, "unknown key 'max_concurent'"),
        ("two", "options must be a dict"),
    ],
)
def test_impossible_http_pools_are_errors(pool, problem):
    from realtime_app.checks.configuration import check_http_pools

    with override_settings(REALTIME_APP={"HTTP_POOLS": {"test": {"max_concurrent": 1}, "reports": pool}}):
        messages = check_http_pools()
    assert ids(messages) == ["realtime_app.E020"] and problem in messages[0].msg


def test_a_decorated_view_needs_its_pool_and_pools_need_the_middleware():
    from django.conf import settings

    from realtime_app.checks.configuration import check_http_pools

    assert check_http_pools() == []  # the test settings: pools, the middleware, the decorated views' pool
    with override_settings(REALTIME_APP={"HTTP_POOLS": {}}):
        messages = check_http_pools()
    assert ids(messages) == ["realtime_app.E021"]  # decorated views still need their pool
    assert "'test'" in messages[0].msg
    middleware = [m for m in settings.MIDDLEWARE if "ConcurrencyLimit" not in m]
    with override_settings(MIDDLEWARE=middleware):
        assert ids(check_http_pools()) == ["realtime_app.W031"]


def test_the_online_backplane_check_runs_only_when_asked():
    """Plain ``check`` (and every command that runs the checks) stays offline; the tag or
    ``--deploy`` asks for the check that connects to Redis."""
    from realtime_app.cluster.online_checks import asked

    assert not asked(["manage.py", "check"]) and not asked(["manage.py", "migrate"])
    assert asked(["manage.py", "check", "--tag", "realtime_backplane"])
    assert asked(["manage.py", "check", "--tag=realtime_backplane"]) and asked(["manage.py", "check", "--deploy"])


@pytest.mark.parametrize("pattern", ["test:lot:<int:id>:500", "test:room:vip-*", "test:room:vip:"])
def test_a_rule_within_a_templates_names_is_a_doubt_not_an_error(pattern):
    """E015 stops ``migrate``: it is said only where no declared name could match (a
    typo of the first segment, ``ordr:``). A rule whose literal part overlaps a template's
    (a cadence of an instance, a glob or a prefix inside its instances) rests on sample
    names: warning W012."""
    with override_settings(REALTIME_APP={"POLICIES": [{"pattern": pattern, "authenticated": True}]}):
        found = ids(check_policies())
    assert "realtime_app.E015" not in found


def test_the_deprecated_declarations_name_is_a_warning_of_the_checks(monkeypatch):
    """Python hides a DeprecationWarning outside ``__main__``: ``manage.py check`` says it."""
    import sys

    from realtime_app.checks.installation import check_old_declarations_name

    monkeypatch.delitem(sys.modules, "realtime_app.channels", raising=False)
    assert check_old_declarations_name() == []
    monkeypatch.setitem(sys.modules, "realtime_app.channels", object())
    assert ids(check_old_declarations_name()) == ["realtime_app.W043"]
