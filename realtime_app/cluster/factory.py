"""Which backplane this process uses: the settings' choice (``BACKPLANE``), built.

Apart from :mod:`realtime_app.cluster.base` (the interface) so that the interface does not
import its implementations, which import it.
"""

from __future__ import annotations

from typing import Any

from realtime_app.cluster.base import Backplane

__all__ = ["backplane_class", "check_postgres", "make_backplane", "postgres_unusable", "redis_backplane_class"]


def backplane_class() -> type[Backplane]:
    """The backplane the settings choose (:func:`realtime_app.conf.chosen_backplane`)."""
    from django.core.exceptions import ImproperlyConfigured
    from django.utils.module_loading import import_string

    from realtime_app.cluster.hosts import layer_kind
    from realtime_app.conf import chosen_backplane, get_config

    choice = chosen_backplane(get_config(), layer_kind())
    if choice == "memory":
        from realtime_app.cluster.memory import MemoryBackplane

        return MemoryBackplane
    if choice == "redis":
        return redis_backplane_class()
    if choice == "postgres":
        why = postgres_unusable(get_config()["BACKPLANE_DATABASE"])
        if why is not None:  # never a traceback per connection: what is wrong, once (check E016)
            raise ImproperlyConfigured(f"realtime_app: BACKPLANE 'postgres' but {why} (realtime_app.E016)")
        from realtime_app.cluster.postgres import PostgresBackplane

        return PostgresBackplane
    if choice == "unsupported_layer":  # never a silent fallback to one process (check E008)
        raise ImproperlyConfigured(
            "realtime_app: the default channel layer is neither channels-redis' nor the in-memory one; "
            "set REALTIME_APP['BACKPLANE'] (see manage.py check, realtime_app.E008)"
        )
    from realtime_app.cluster.roles import missing_methods

    try:
        cls: type[Backplane] = import_string(choice)
    except ImportError as exc:  # a misspelled name: what is wrong, once (check E003)
        raise ImproperlyConfigured(
            f"realtime_app: BACKPLANE {choice!r} does not import: {exc} (realtime_app.E003)"
        ) from exc
    missing = missing_methods(cls)
    if missing:  # never a hub that fails a beat a second: say which methods, once (check E003)
        raise ImproperlyConfigured(
            f"realtime_app: BACKPLANE {choice!r} does not implement {', '.join(missing)} (realtime_app.E003)"
        )
    return cls


def redis_backplane_class() -> type[Backplane]:
    """One Redis server, or several: a sharded backplane (:mod:`realtime_app.cluster.shards`);
    or a Redis Cluster (:mod:`realtime_app.cluster.redis_cluster`)."""
    from realtime_app.cluster.hosts import shard_hosts
    from realtime_app.cluster.redis import RedisBackplane
    from realtime_app.conf import get_config

    if get_config()["REDIS_CLUSTER"]:
        from realtime_app.cluster.redis_cluster import ClusterBackplane

        return ClusterBackplane
    if len(shard_hosts(get_config())) > 1:
        from realtime_app.cluster.shards import ShardedBackplane

        return ShardedBackplane
    return RedisBackplane


def make_backplane(instance_id: str = "headless") -> Backplane:
    """Build the configured backplane (``"headless"``: publish or read probes, no receiving)."""
    from realtime_app.conf import get_config

    return backplane_class()(instance_id=instance_id, config=get_config())


def postgres_unusable(alias: Any) -> str | None:
    """Why ``BACKPLANE = "postgres"`` cannot run on the database ``alias`` (None: it can):
    the one rule of check E016 and of the backplane's factory."""
    from django.conf import settings as django_settings
    from django.db import connections

    databases = getattr(django_settings, "DATABASES", {}) or {}
    if not isinstance(alias, str) or alias not in databases:
        return f"its database BACKPLANE_DATABASE {alias!r} is not in DATABASES"
    try:
        vendor = connections[alias].vendor
    except Exception as exc:  # an ENGINE that does not import
        vendor = f"unknown ({exc})"
    if vendor != "postgresql":
        return f"its database BACKPLANE_DATABASE {alias!r} is not a PostgreSQL one"
    try:  # Django runs on psycopg2 too; the backplane does not
        import psycopg  # noqa: F401
    except ImportError:
        return "it needs psycopg 3 (pip install 'psycopg[binary]' or 'realtime-app[postgres]'), which is not installed"
    return None


def check_postgres(alias: Any) -> list[Any]:
    """E016: ``BACKPLANE = "postgres"`` on a database alias that is not a PostgreSQL one,
    or without psycopg 3."""
    from django.core.checks import Error

    why = postgres_unusable(alias)
    if why is None:
        return []
    return [
        Error(
            f"REALTIME_APP['BACKPLANE'] is 'postgres' but {why}.",
            hint="Name a DATABASES alias whose ENGINE is django.db.backends.postgresql, install psycopg 3, then "
            "run manage.py migrate on it (docs/postgres-backplane.md).",
            id="realtime_app.E016",
        )
    ]
