"""The check that goes online: every Redis server the backplane is configured with is
reached, asked ``PING`` and whether it is a plain Redis — so that an unreachable,
misspelled or wrong-kind host is found before deploying, not by the first page.

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

__all__ = ["TAG", "asked", "check_backplane_servers"]

TAG = "realtime_backplane"
#: How long each server may take to answer, seconds (at most the backplane's own timeout).
TIMEOUT_S = 3.0


def asked(argv: list[str] | None = None) -> bool:
    """Whether the command line asks for the online check: ``--deploy``, or its tag."""
    argv = sys.argv if argv is None else argv
    return "--deploy" in argv or TAG in argv or f"--tag={TAG}" in argv


@register(TAG)
def check_backplane_servers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E012: a configured Redis server that does not answer, or is a Redis Cluster node."""
    if not asked():
        return []
    from realtime_app.cluster.factory import backplane_class
    from realtime_app.cluster.redis import RedisBackplane, host_label, shard_hosts

    config = get_config()
    try:
        if not issubclass(backplane_class(), RedisBackplane):
            return []
        hosts = shard_hosts(config)
    except Exception:  # the offline checks (E003, E005, E008, E011) say what is wrong
        return []
    problems = asyncio.run(_ask_all(config, hosts))
    return [
        Error(
            f"The backplane's Redis {host_label(host)} {problem}.",
            hint="Check REALTIME_APP['REDIS_URL'] / ['REDIS_SHARDS'] or the channel layer's hosts: the realtime "
            "endpoint is down while its Redis is (pages are not) — docs/deployment.md.",
            obj=host_label(host),
            id="realtime_app.E012",
        )
        for host, problem in zip(hosts, problems, strict=True)
        if problem is not None
    ]


async def _ask_all(config: dict[str, Any], hosts: list[dict[str, Any]]) -> list[str | None]:
    return list(await asyncio.gather(*(_ask(config, host) for host in hosts)))


async def _ask(config: dict[str, Any], host: dict[str, Any]) -> str | None:
    """Why ``host`` cannot carry the backplane (None: it can)."""
    from realtime_app.cluster.hosts import redis_client

    timeout_ms = min(config["REDIS_TIMEOUT_MS"], int(TIMEOUT_S * 1000))
    client = redis_client({**config, "REDIS_TIMEOUT_MS": timeout_ms}, host)
    try:
        async with asyncio.timeout(TIMEOUT_S * 2):
            await client.ping()
            cluster = await client.info("cluster")
    except Exception as exc:
        return f"does not answer ({type(exc).__name__}: {exc})"
    finally:
        await client.aclose()
    if int(cluster.get("cluster_enabled", 0)):
        return "is a Redis Cluster node: the backplane uses plain Redis servers or Sentinel services (REDIS_SHARDS)"
    return None
