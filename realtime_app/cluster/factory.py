"""Which backplane this process uses: the settings' choice (``BACKPLANE``), built.

Apart from :mod:`realtime_app.cluster.base` (the interface) so that the interface does not
import its implementations, which import it.
"""

from __future__ import annotations

from realtime_app.cluster.base import Backplane

__all__ = ["backplane_class", "make_backplane", "redis_backplane_class"]


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
        from realtime_app.cluster.postgres import PostgresBackplane

        return PostgresBackplane
    if choice == "unsupported_layer":  # never a silent fallback to one process (check E008)
        raise ImproperlyConfigured(
            "realtime_app: the default channel layer is neither channels-redis' nor the in-memory one; "
            "set REALTIME_APP['BACKPLANE'] (see manage.py check, realtime_app.E008)"
        )
    from realtime_app.cluster.roles import missing_methods

    cls: type[Backplane] = import_string(choice)
    missing = missing_methods(cls)
    if missing:  # never a hub that fails a beat a second: say which methods, once (check E003)
        raise ImproperlyConfigured(f"realtime_app: BACKPLANE {choice!r} does not implement {', '.join(missing)}")
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
