"""The backplane by role (``realtime_app.cluster.roles``): five small interfaces that
split the one it was (24 methods), so that a new store implements only what it stores and
the hub's rooms name the role they use (the import contracts hold the rest)."""

from __future__ import annotations

import inspect

import pytest

from realtime_app.cluster import roles
from realtime_app.cluster.base import Backplane
from realtime_app.cluster.memory import MemoryBackplane
from realtime_app.cluster.postgres import PostgresBackplane
from realtime_app.cluster.redis import RedisBackplane
from realtime_app.cluster.redis_cluster import ClusterBackplane
from realtime_app.cluster.shards import ShardedBackplane

ROLES = [roles.Broker, roles.HistoryStore, roles.PresenceStore, roles.LeaseStore, roles.OnceStore]

SHIPPED = [MemoryBackplane, RedisBackplane, ShardedBackplane, ClusterBackplane, PostgresBackplane]


def own_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("_")}


def test_the_roles_split_the_interface_each_method_in_one_role() -> None:
    seen: dict[str, str] = {}
    for role in ROLES:
        for name in own_methods(role):
            assert name not in seen, f"{name} is in {seen[name]} and {role.__name__}"
            seen[name] = role.__name__
    assert max(len(own_methods(role)) for role in ROLES) <= 8  # small interfaces, not one of 24
    interface = {name for name in dir(Backplane) if not name.startswith("_") and callable(getattr(Backplane, name))}
    assert interface - set(seen) <= own_methods(roles.Reachable)


@pytest.mark.parametrize("backplane", SHIPPED)
@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.__name__)
def test_every_backplane_implements_every_role(backplane: type, role: type) -> None:
    """A backplane that leaves a role's method to the interface raises at its first use;
    here, before any process runs it. One process in memory shares no bucket and no
    idempotency book: it says so (``NotImplementedError``, documented), and each process
    keeps its own."""
    for name in own_methods(role):
        if name in roles.SHARED_BOOKS:
            continue
        implementation = getattr(backplane, name)
        assert "NotImplementedError" not in inspect.getsource(implementation), f"{backplane.__name__}.{name}"


@pytest.mark.parametrize("backplane", SHIPPED)
def test_the_shipped_backplanes_miss_no_method(backplane: type) -> None:
    assert roles.missing_methods(backplane) == []


def test_a_backplane_missing_methods_is_named_by_the_check_and_refused_at_start() -> None:
    """Found: a project's backplane with a few methods passed ``check`` and ``/realtime/ready``,
    then logged a bare NotImplementedError every second and delivered nothing."""
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from realtime_app.checks.backplane import check_backplane
    from realtime_app.cluster.factory import make_backplane
    from tests.testapp.backplanes import PartialBackplane

    missing = roles.missing_methods(PartialBackplane)
    assert "LeaseStore.acquire" in missing and "Broker.check" in missing and "Broker.publish" not in missing
    [error] = check_backplane("tests.testapp.backplanes.PartialBackplane")
    assert error.id == "realtime_app.E003" and "LeaseStore.acquire" in error.msg
    with override_settings(REALTIME_APP={"BACKPLANE": "tests.testapp.backplanes.PartialBackplane"}):
        with pytest.raises(ImproperlyConfigured, match="LeaseStore.acquire"):
            make_backplane()
    [unimportable] = check_backplane("tests.no_such_module.Backplane")
    assert "No module named" in unimportable.msg  # the import's own error, not only "not a subclass"
