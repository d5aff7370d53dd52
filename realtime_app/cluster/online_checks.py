"""The checks that go online: every Redis server the backplane (and the channels-redis
layer) is configured with is reached, asked ``PING`` and what kind it is — a plain Redis,
or a Redis Cluster node of Redis 7 or newer for ``REDIS_CLUSTER`` — and the PostgreSQL
backplane's database is reached, asked for its tables and its ``max_connections``, so that
an unreachable, misspelled or wrong-kind host, or a database too small for the processes,
is found before deploying, not by the first page.

Asked for by its tag (``manage.py check --tag realtime_backplane``) or with ``--deploy``;
plain ``check`` — and every command that runs the checks — stays offline. Django's check
framework tells a check neither, so the command line says it (a check registered with
``deploy=True`` would not answer to its tag alone).
Ids in docs/checks.md.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from django.core.checks import CheckMessage, Error, register

from realtime_app.conf import get_config

__all__ = ["TAG", "asked", "check_backplane_servers", "check_postgres_budget", "postgres_problem", "why_not"]

TAG = "realtime_backplane"
#: How long each server may take to answer, seconds (at most the backplane's own timeout).
TIMEOUT_S = 3.0


def asked(argv: list[str] | None = None) -> bool:
    """Whether the command line asks for the online check: ``--deploy``, or its tag."""
    argv = sys.argv if argv is None else argv
    return "--deploy" in argv or TAG in argv or f"--tag={TAG}" in argv


@register(TAG)
def check_backplane_servers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E012: a configured Redis server that does not answer, a Redis Cluster node where a
    plain server is expected (the backplane's or the channel layer's), or a
    ``REDIS_CLUSTER`` node that is not one, runs Redis below 7 or whose cluster is down."""
    if not asked():
        return []
    from realtime_app.cluster.factory import backplane_class
    from realtime_app.cluster.hosts import host_label, layer_hosts, shard_hosts, uses_channels_redis
    from realtime_app.cluster.redis import RedisBackplane

    config = get_config()
    try:
        if not issubclass(backplane_class(), RedisBackplane) and not config["REDIS_CLUSTER"]:
            return []
        cluster = list(config["REDIS_CLUSTER"] or [])
        hosts = [] if cluster or not (config["REDIS_URL"] or config["REDIS_SHARDS"]) else shard_hosts(config)
        layer = layer_hosts() if uses_channels_redis() else []  # (the backplane's too, when nothing else is named)
    except Exception:  # the offline checks (E003, E005, E008, E011, E014) say what is wrong
        return []
    asked_hosts = [*hosts, *[{"address": url} for url in cluster], *layer]
    kinds = ["backplane"] * len(hosts) + ["cluster"] * len(cluster) + ["layer"] * len(layer)
    answers = asyncio.run(_ask_all(config, asked_hosts))
    errors = []
    for host, kind, answer in zip(asked_hosts, kinds, answers, strict=True):
        problem = answer if isinstance(answer, str) else why_not(kind, answer)
        if problem is not None:
            errors.append(
                Error(
                    f"The {'channel layer' if kind == 'layer' else 'backplane'}'s Redis {host_label(host)} {problem}.",
                    hint=HINTS[kind],
                    obj=host_label(host),
                    id="realtime_app.E012",
                )
            )
    return errors


HINTS = {
    "backplane": "Check REALTIME_APP['REDIS_URL'] / ['REDIS_SHARDS'] or the channel layer's hosts: the realtime "
    "endpoint is down while its Redis is (pages are not) — docs/deployment.md.",
    "cluster": "REALTIME_APP['REDIS_CLUSTER'] lists startup nodes of a Redis Cluster, Redis 7 or newer "
    "(docs/redis-cluster.md).",
    "layer": "Check CHANNEL_LAYERS['default']['CONFIG']['hosts']: the channel layer (and the backplane, unless "
    "REALTIME_APP names its Redis) is down while its Redis is — docs/deployment.md, docs/redis-cluster.md.",
}


def why_not(kind: str, info: dict[str, Any]) -> str | None:
    """Why a server that answered cannot be what it is configured as (None: it can).
    ``info``: its ``redis_version``, ``cluster_enabled`` and ``cluster_state``."""
    clustered = bool(int(info.get("cluster_enabled", 0)))
    if kind != "cluster":
        if clustered and kind == "layer":
            return (
                "is a Redis Cluster node: channels-redis cannot use a Redis Cluster — keep the channel layer on a "
                "plain Redis (or the in-memory layer) and set REALTIME_APP['REDIS_CLUSTER'] to the cluster's node "
                "URLs for the backplane"
            )
        if clustered:
            return (
                "is a Redis Cluster node: set REALTIME_APP['REDIS_CLUSTER'] to the cluster's node URLs instead of "
                "naming it in REDIS_URL / REDIS_SHARDS"
            )
        return None
    if not clustered:
        return "is not a Redis Cluster node (cluster_enabled:0): name a plain server in REDIS_URL or REDIS_SHARDS"
    version = str(info.get("redis_version", "0"))
    if int(version.split(".")[0] or 0) < 7:
        return f"runs Redis {version}: the backplane's sharded pub/sub (SPUBLISH, SSUBSCRIBE) needs Redis 7 or newer"
    if info.get("cluster_state") != "ok":
        return f"says its cluster is {info.get('cluster_state')!r}, not 'ok': a slot has no master"
    return None


async def _ask_all(config: dict[str, Any], hosts: list[dict[str, Any]]) -> list[str | dict[str, Any]]:
    return list(await asyncio.gather(*(_ask(config, host) for host in hosts)))


async def _ask(config: dict[str, Any], host: dict[str, Any]) -> str | dict[str, Any]:
    """What ``host`` says of itself, or why it does not answer."""
    from realtime_app.cluster.hosts import close_client, redis_client

    timeout_ms = min(config["REDIS_TIMEOUT_MS"], int(TIMEOUT_S * 1000))
    client = redis_client({**config, "REDIS_TIMEOUT_MS": timeout_ms}, host)
    try:
        async with asyncio.timeout(TIMEOUT_S * 2):
            await client.ping()
            info = {**(await client.info("server")), **(await client.info("cluster"))}
            if int(info.get("cluster_enabled", 0)):
                info["cluster_state"] = _text(await client.execute_command("CLUSTER INFO"))
    except Exception as exc:
        return f"does not answer ({type(exc).__name__}: {exc})"
    finally:
        await close_client(client)
    return info


def _text(cluster_info: Any) -> str:
    """``cluster_state`` of ``CLUSTER INFO`` (redis-py parses it to a dict, or not)."""
    if isinstance(cluster_info, dict):
        return str(cluster_info.get("cluster_state", ""))
    text = cluster_info.decode() if isinstance(cluster_info, bytes) else str(cluster_info)
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.partition(":")[2].strip()
    return ""


@register(TAG)
def check_postgres_budget(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E017: the PostgreSQL backplane's database does not answer, has no backplane tables
    (``migrate`` was not run on it), or its ``max_connections`` cannot hold
    ``POSTGRES_MAX_PROCESSES`` processes of (1 listening + ``POSTGRES_POOL_SIZE`` + 1 of
    Django's own) connections each, beside the superusers' reserve."""
    if not asked():
        return []
    from realtime_app.cluster.factory import check_postgres

    config = get_config()
    if config["BACKPLANE"] != "postgres":
        return []
    # `check --tag` runs this check alone: what the offline check would say comes first
    # (a database that is not PostgreSQL's is not connected to).
    static = check_postgres(config["BACKPLANE_DATABASE"])
    if static:
        return static
    from realtime_app.cluster.postgres_pool import connection_params, label

    params = connection_params(config)
    problem = postgres_problem(params, config["POSTGRES_MAX_PROCESSES"], config["POSTGRES_POOL_SIZE"])
    if problem is None:
        return []
    hint = (
        "docs/postgres-backplane.md#connections: lower POSTGRES_POOL_SIZE or POSTGRES_MAX_PROCESSES, raise "
        "max_connections, or put PgBouncer in front of Django's own connections (not the backplane's: LISTEN "
        "needs a session)."
    )
    if "migrate" in problem:
        hint = "manage.py migrate makes them (docs/postgres-backplane.md)."
    elif problem.startswith("does not answer"):
        hint = f"Check DATABASES[{config['BACKPLANE_DATABASE']!r}] and that the server runs."
    return [
        Error(
            f"The backplane's PostgreSQL {label(params)} {problem}.",
            hint=hint,
            obj=label(params),
            id="realtime_app.E017",
        )
    ]


def postgres_problem(params: dict[str, Any], processes: int, pool_size: int) -> str | None:
    """Why the database cannot carry ``processes`` processes of the backplane (None: it can)."""
    import psycopg

    from realtime_app.cluster.postgres import TABLES_THERE

    try:
        with psycopg.connect(**{**params, "connect_timeout": int(TIMEOUT_S), "autocommit": True}) as conn:
            tables = conn.execute(TABLES_THERE).fetchone()
            limit = int(conn.execute("SHOW max_connections").fetchone()[0])  # type: ignore[index]
            reserved = int(conn.execute("SHOW superuser_reserved_connections").fetchone()[0])  # type: ignore[index]
    except Exception as exc:
        return f"does not answer ({type(exc).__name__}: {exc})"
    if not (tables and tables[0]):
        return "has no realtime_app backplane tables: run manage.py migrate (--database for another alias)"
    needed = processes * (pool_size + 2)
    if needed > limit - reserved:
        return (
            f"allows {limit - reserved} connections (max_connections {limit} less {reserved} reserved) and "
            f"POSTGRES_MAX_PROCESSES {processes} processes need {needed} ({pool_size + 2} each: 1 listening, "
            f"POSTGRES_POOL_SIZE {pool_size}, 1 of Django's own)"
        )
    return None
