"""A private Redis Cluster for the cluster backplane's tests: masters and a replica each,
on free ports, built with the cluster commands themselves (no ``redis-cli`` needed).

The tests break this one (kill a master, fail over to a replica), never the machine's
shared Redis. It needs ``redis-server`` 7 or newer (sharded pub/sub): an older one fails
the test, never skips it.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from tests.support.private_redis import PrivateRedis
from tests.support.servers import free_port

SLOTS = 16384


class PrivateRedisCluster:
    """``masters`` masters, each with ``replicas`` replicas, slots split evenly."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.masters = masters
        self.options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        self.options += ("--cluster-node-timeout", str(node_timeout_ms))
        count = masters * (1 + replicas)
        # The bus port named: the default (port + 10000) is out of range for a high free port.
        self.bus_ports = [free_port() for _ in range(count)]
        self.nodes = [PrivateRedis(*self.options, "--cluster-port", str(bus)) for bus in self.bus_ports]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def client(self, node: PrivateRedis) -> redis.Redis:
        return node.client()

    def start(self) -> PrivateRedisCluster:
        try:
            for i in range(len(self.nodes)):
                self._start_node(i)
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def _start_node(self, i: int) -> None:
        """Node ``i``, on other free ports when one was taken meanwhile (the machine is shared)."""
        for attempt in range(5):
            try:
                self.nodes[i].start()
                return
            except RuntimeError:
                if attempt == 4:
                    raise
                self.nodes[i].close()
                self.bus_ports[i] = free_port()
                self.nodes[i] = PrivateRedis(*self.options, "--cluster-port", str(self.bus_ports[i]))

    def _form(self) -> None:
        clients = [node.client() for node in self.nodes]
        version = clients[0].info("server")["redis_version"]
        if int(version.split(".")[0]) < 7:
            raise RuntimeError(f"the cluster tests need redis-server 7 or newer (sharded pub/sub), found {version}")
        ids = [c.execute_command("CLUSTER MYID") for c in clients]
        step = SLOTS // self.masters
        for i, c in enumerate(clients[: self.masters]):
            last = SLOTS - 1 if i == self.masters - 1 else (i + 1) * step - 1
            c.execute_command("CLUSTER ADDSLOTSRANGE", i * step, last)
        for c in clients[1:]:
            c.execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[0].port, self.bus_ports[0])
        wait_for(lambda: all(len(c.cluster("nodes")) == len(clients) for c in clients))
        for i, c in enumerate(clients[self.masters :]):
            master = ids[i % self.masters]
            wait_for(lambda c=c, master=master: _replicate(c, master))
        wait_for(lambda: all(c.cluster("info")["cluster_state"] == "ok" for c in clients))
        wait_for(lambda: all(c.info("replication").get("master_link_status") == "up" for c in clients[self.masters :]))
        for c in clients:
            c.close()

    def shards(self) -> list[dict[str, Any]]:
        """``[{"slots": [(a, b), ...], "master": port, "replicas": [port, ...]}]`` as a live node sees it."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            try:
                raw = node.client().execute_command("CLUSTER SHARDS")
            except redis.RedisError:
                continue
            return [shard for shard in map(_shard, raw) if shard is not None and shard["slots"]]
        raise RuntimeError("no node of the cluster answers")

    def node(self, port: int) -> PrivateRedis:
        return next(node for node in self.nodes if node.port == port)

    def master_of(self, key: str) -> PrivateRedis:
        """The master of ``key``'s slot (waiting, while a failover is under way, for one)."""
        deadline = time.monotonic() + 30
        while (master := self.owner(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no master holds the slot of {key!r}")
            time.sleep(0.05)
        return master

    def owner(self, key: str) -> PrivateRedis | None:
        """The master of ``key``'s slot as a live node sees it now; None while it has none."""
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for shard in self.shards():
            if any(a <= slot <= b for a, b in shard["slots"]):
                return self.node(shard["master"])
        return None

    def rejoin(self, node: PrivateRedis) -> None:
        """Start a killed node again: it rejoins as a replica of whoever took its slots."""
        node.start()
        wait_for(lambda: node.client().info("replication").get("master_link_status") == "up")
        wait_for(lambda: all(n.client().cluster("info")["cluster_state"] == "ok" for n in self.live()))

    def wait_ok(self) -> None:
        """Every live node says the cluster is ok and every replica is in sync."""
        wait_for(lambda: all(n.client().cluster("info")["cluster_state"] == "ok" for n in self.live()))
        wait_for(lambda: all(_synced(n.client()) for n in self.live()))

    def live(self) -> list[PrivateRedis]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def _synced(client: redis.Redis) -> bool:
    replication = client.info("replication")
    return replication["role"] == "master" or replication.get("master_link_status") == "up"


def _replicate(client: redis.Redis, master: str) -> bool:
    try:
        client.execute_command("CLUSTER REPLICATE", master)
    except redis.ResponseError:  # the master is not known to this node yet
        return False
    return True


def _shard(item: Any) -> dict[str, Any] | None:
    info = dict(zip(item[::2], item[1::2], strict=True)) if isinstance(item, list) else dict(item)
    slots = info["slots"]
    nodes = [dict(zip(n[::2], n[1::2], strict=True)) if isinstance(n, list) else dict(n) for n in info["nodes"]]
    master = next((n for n in nodes if n["role"] == "master" and n.get("health") == "online"), None)
    if master is None:
        return None
    return {
        "slots": [(int(slots[i]), int(slots[i + 1])) for i in range(0, len(slots), 2)],
        "master": int(master["port"]),
        "replicas": [int(n["port"]) for n in nodes if n["role"] == "replica"],
    }


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the private Redis Cluster did not reach the state in time")
        time.sleep(0.05)
