"""The cluster backplane on channels-redis (and its Redis).

Each process owns one layer channel and is a member of a channel's group while it has
local subscribers, so a publication costs one backplane message per subscribed process.
A lease per ticker channel (``SET NX PX``, renewed by its holder) elects the one process
that runs the ticker; a Lua ``INCR`` numbers publications cluster-wide, above a floor the
publisher supplies, so ``seq`` survives a failover and never goes back even when Redis
loses its data. Probes are keys with a TTL, so the cluster view lists live processes only.

Nothing here is assumed to stay in Redis: :meth:`RedisBackplane.check` keeps a sentinel
key per process whose disappearance (restart, flush, eviction) or expiry (every
``REASSERT_INTERVAL_MS``, and always well within channels-redis' ``group_expiry``) tells
the hub to join every group and reseed every sequence again.

Group membership is written exactly as channels-redis 4.3's ``group_add`` does (the
layer's own key and shard), but pipelined, so a re-assert of a thousand groups is one
round trip per shard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from .admission import retry_after_ms
from .backplane import Backplane, Deliver, Delivery, now_ms
from .cancellation import cancel_and_wait
from .history import PAGE, PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since, epoch_suffix
from .names import group_name
from .protocol import notification_head, notification_tail

__all__ = ["RedisBackplane", "channels_redis_tested", "group_send_inline", "uses_channels_redis"]

logger = logging.getLogger("realtime_app.backplane")

FRAME = "realtime.frame"
RELEASED = "realtime.released"

# Keep the lease, or take it again if it vanished (Redis restarted empty): the holder
# keeps its ticker across a restart instead of stopping and starting it.
_RENEW = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
# The next seq, above the publisher's floor; the key expires when the channel is idle.
_NUMBER = """
local v = redis.call('incr', KEYS[1])
local floor = tonumber(ARGV[1])
if v <= floor then
  v = floor + 1
  redis.call('set', KEYS[1], v)
end
redis.call('pexpire', KEYS[1], ARGV[2])
"""
_SEQ = _NUMBER + "return v\n"
# channels-redis 4.3's ``group_send``, byte for byte what it stores (expired members and
# messages dropped, a member's capacity honoured, a random prefix, msgpack), run in the
# call that numbers the publication: one round trip instead of five. The score is Redis'
# clock when the number is taken, so a member's queue pops in ``seq`` order. ARGV from
# ``a``: layer prefix, group expiry, message expiry, capacity, random prefix, channel.
_GROUP_SEND = """
local function group_send(group_key, a, fields)
  local t = redis.call('time')
  local now = tonumber(t[1])
  local score = string.format('%d.%06d', now, tonumber(t[2]))
  redis.call('zremrangebyscore', group_key, 0, now - tonumber(ARGV[a + 1]))
  local over = 0
  for _, member in ipairs(redis.call('zrange', group_key, 0, -1)) do
    local bang = string.find(member, '!', 1, true)
    local key = ARGV[a] .. (bang and string.sub(member, 1, bang) or member)
    fields['__asgi_channel__'] = {member}
    redis.call('zremrangebyscore', key, 0, now - tonumber(ARGV[a + 2]))
    if redis.call('zcount', key, '-inf', '+inf') < tonumber(ARGV[a + 3]) then
      redis.call('zadd', key, score, ARGV[a + 4] .. cmsgpack.pack(fields))
      redis.call('expire', key, ARGV[a + 2])
    else
      over = over + 1
    end
  end
  return over
end
"""
# KEYS: seq, group; ARGV: floor, keep ms, head, ts, then the group send's from 5
_PUBLISH = (
    _GROUP_SEND
    + _NUMBER
    + """
local s = string.format('%d', v)
local text = ARGV[3] .. ',"seq":' .. s .. ',"ts":' .. ARGV[4] .. '}}'
local over = group_send(KEYS[2], 5, {type = 'realtime.frame', channel = ARGV[10], text = text, seq = v})
return {v, over}
"""
)
_RESEED = """
local cur = tonumber(redis.call('get', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then redis.call('set', KEYS[1], ARGV[1], 'KEEPTTL') end
if redis.call('pttl', KEYS[1]) < tonumber(ARGV[2]) then redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
# A channel with history (docs/recovery.md): its count, its epoch and its stream. The
# count and the epoch live and die together, and the epoch belongs to one run of Redis: if
# either key is gone (flush, restart, eviction) or Redis restarted from a snapshot (the
# count came back behind what clients saw), the history is lost and a new epoch begins —
# named by Redis' clock, so that epochs order as strings. Each publication is numbered
# and kept in one call: the stream's order is seq order.
_LINEAGE = """
local run = string.match(redis.call('info', 'server'), 'run_id:(%x+)') or ''
local stored = redis.call('get', KEYS[2])
local epoch, owner
if stored then epoch, owner = string.match(stored, '^(%S+) (%S*)$') end
local top = redis.call('get', KEYS[1])
local renewed = false
local function renew()
  renewed = true
  local t = redis.call('time')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if epoch and string.len(epoch) == 19 then  -- never older than the one replaced (a clock behind)
    ms = math.max(ms, (tonumber(string.sub(epoch, 1, 11), 16) or 0) + 1)
  end
  epoch = string.format('%011x', ms) .. ARGV[1]
  redis.call('del', KEYS[3], KEYS[4])
end
if not epoch or owner ~= run or not top then renew() end
"""
# KEYS: seq, epoch, stream, largest entry[, group]; ARGV: new epoch, keep ms, floor, head,
# ts, size, ttl ms[, the group send's from 8]
_PUBLISH_KEPT = (
    _GROUP_SEND
    + _LINEAGE
    + """
local incremented = redis.call('incr', KEYS[1])
local v = incremented
if v <= tonumber(ARGV[3]) then v = tonumber(ARGV[3]) + 1 end
local s = string.format('%d', v)
local text
local function add()
  text = ARGV[4] .. ',"seq":' .. s .. ',"epoch":"' .. epoch .. '","ts":' .. ARGV[5] .. '}}'
  return redis.pcall('xadd', KEYS[3], 'MAXLEN', ARGV[6], s .. '-0', 't', text, 'ts', ARGV[5])
end
local added = add()
if type(added) == 'table' and added.err then
  renew()  -- the stream outlived the count: a new history
  add()
end
if renewed or v ~= incremented or redis.call('pttl', KEYS[1]) < tonumber(ARGV[2]) / 2 then
  redis.call('set', KEYS[1], s, 'PX', ARGV[2])  -- INCR keeps the TTL: set it now and then
  redis.call('set', KEYS[2], epoch .. ' ' .. run, 'PX', ARGV[2])
end
redis.call('pexpire', KEYS[3], ARGV[7])
local size = string.len(text)  -- the largest entry bounds each read's bytes (_PAGE)
if size > tonumber(redis.call('get', KEYS[4]) or '0') then redis.call('set', KEYS[4], size) end
redis.call('pexpire', KEYS[4], ARGV[7])
local over = 0
if KEYS[5] then
  over = group_send(KEYS[5], 8, {type = 'realtime.frame', channel = ARGV[13], text = text, seq = v, epoch = epoch})
end
return {v, epoch, over}
"""
)
# A page of a history, bounded in entries and in bytes: each XRANGE asks for no more
# entries than fit in what is left of the byte budget at the size of the largest entry
# kept, so no call copies much more than the budget whatever the events' size (at least one
# entry; a history without a known largest entry is read one entry per call).
_PAGE = """
local function page(stream, largest, after, count, budget)
  local biggest = tonumber(redis.call('get', largest) or '0')
  if biggest <= 0 then biggest = budget end
  local out, used, nextseq = {}, 0, after + 1
  while #out < count do
    local n = math.floor((budget - used) / biggest)
    if n < 1 then
      if #out > 0 then break end
      n = 1
    end
    n = math.min(n, count - #out)
    local got = redis.call('xrange', stream, string.format('%d-0', nextseq), '+', 'COUNT', n)
    for i = 1, #got do
      out[#out + 1] = got[i]
      used = used + string.len(got[i][2][2])
    end
    if #got < n then break end
    nextseq = tonumber(string.match(got[#got][1], '^(%d+)')) + 1
  end
  return out
end
"""
# KEYS: stream, largest entry; ARGV: after, count, bytes
_READ_PAGE = _PAGE + "return page(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))\n"
# KEYS: seq, epoch, stream, largest entry; ARGV: new epoch, keep ms, since (-1: none), its
# epoch, size, page, floor, page bytes
_READ_KEPT = (
    _LINEAGE
    + _PAGE
    + """
top = math.max(tonumber(top or '0'), tonumber(ARGV[7]))
redis.call('set', KEYS[1], string.format('%d', top), 'PX', ARGV[2])
redis.call('set', KEYS[2], epoch .. ' ' .. run, 'PX', ARGV[2])
local since = tonumber(ARGV[3])
local entries = {}
if since >= 0 and epoch == ARGV[4] and top > since and top - since <= tonumber(ARGV[5]) then
  entries = page(KEYS[3], KEYS[4], since, tonumber(ARGV[6]), tonumber(ARGV[8]))
end
return {epoch, top, redis.call('xlen', KEYS[3]), entries}
"""
)
#: How long a channel's count and epoch outlive its last publication or read (at least):
#: an idle day does not start a new history, so a client back after it is told exactly
#: whether it missed anything.
KEEP_LINEAGE_MS = 86_400_000
# One token bucket shared by the cluster (an identity on several processes), refilled
# lazily with Redis' clock so that the processes' clocks never disagree about it.
_TAKE = """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cost, cap, rate = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('hmget', KEYS[1], 'tokens', 'stamp')
local tokens, stamp = tonumber(b[1]), tonumber(b[2])
if tokens == nil or stamp == nil then tokens, stamp = cap, now end
tokens = math.min(cap, tokens + math.max(0, now - stamp) * rate)
local wait = 0
if tokens >= cost then tokens = tokens - cost else wait = (cost - tokens) / rate end
redis.call('hset', KEYS[1], 'tokens', string.format('%.17g', tokens), 'stamp', string.format('%.17g', now))
redis.call('pexpire', KEYS[1], ARGV[4])
return string.format('%.17g', wait)
"""


#: channels-redis versions whose stored format ``_GROUP_SEND`` writes, as
#: ``tests/test_backplane_wire.py`` checks; with another, the layer's own ``group_send``.
TESTED_CHANNELS_REDIS = ("4.3.",)


def channels_redis_tested() -> bool:
    """True when the installed channels-redis is one ``_GROUP_SEND`` was written against."""
    from importlib import metadata

    try:
        return metadata.version("channels-redis").startswith(TESTED_CHANNELS_REDIS)
    except metadata.PackageNotFoundError:
        return False


def group_send_inline(layer: Any, settings: dict[str, Any]) -> bool:
    """True when a publication's Lua call can also do channels-redis' ``group_send``: the
    layer has one Redis, the backplane's own, and stores msgpack without encryption (the
    script packs with Redis' ``cmsgpack`` and cannot encrypt), and channels-redis is a
    version whose format the script writes (check W021). Otherwise the layer's
    ``group_send`` follows the numbering call."""
    hosts = getattr(layer, "hosts", None) or []
    serializer = getattr(layer, "_serializer", None)
    if (
        not channels_redis_tested()
        or len(hosts) != 1
        or type(serializer).__name__ != "MsgPackSerializer"
        or getattr(serializer, "crypter", None)
    ):
        return False
    # Only a bare address: the backplane's client is built from the URL alone, and a ``db``
    # or any other option of the host would put the group where the script does not look.
    host = dict(hosts[0])
    return set(host) == {"address"} and settings["REDIS_URL"] in (None, host["address"])


def uses_channels_redis() -> bool:
    """True when the default channel layer is channels-redis' (the cluster backplane fits)."""
    from channels.layers import get_channel_layer
    from channels_redis.core import RedisChannelLayer

    return isinstance(get_channel_layer(), RedisChannelLayer)


class RedisBackplane(Backplane):
    """A cluster of processes sharing the channels-redis layer (and its Redis)."""

    clustered = True
    errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

    def __init__(
        self,
        *,
        instance_id: str = "headless",
        config: dict[str, Any] | None = None,
        layer: Any = None,
        redis: Any = None,
    ) -> None:
        super().__init__(instance_id=instance_id, config=config)
        from .conf import DEFAULTS

        settings = {**DEFAULTS, **(config or {})}
        if layer is None:
            from channels.layers import get_channel_layer

            layer = get_channel_layer()
        self.layer = layer
        self.prefix: str = settings["KEY_PREFIX"]
        self.lease_ttl_ms: int = settings["LEASE_TTL_MS"]
        self.seq_ttl_ms: int = settings["SEQ_IDLE_TTL_MS"]
        expiry_ms = int(getattr(layer, "group_expiry", 86400)) * 1000
        self.reassert_ms: int = max(1000, min(settings["REASSERT_INTERVAL_MS"], expiry_ms // 3))
        self.redis = redis if redis is not None else _client(layer, settings)
        self._owns_pool = redis is None  # a pool made here is closed by stop()
        # Bound what this process asks of the layer's own pools at once (they raise, not
        # wait, past their size): a burst of subscribes queues here instead of failing.
        self._slots = asyncio.Semaphore(settings["REDIS_MAX_CONNECTIONS"])
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._seq = self.redis.register_script(_SEQ)
        self._reseed = self.redis.register_script(_RESEED)
        self._take = self.redis.register_script(_TAKE)
        self._publish_kept = self.redis.register_script(_PUBLISH_KEPT)
        self._read_page = self.redis.register_script(_READ_PAGE)
        self._publish = self.redis.register_script(_PUBLISH)
        #: The publishing script also does the layer's group send (one round trip a
        #: publication) where it can: see :func:`group_send_inline`.
        self.inline_group_send = group_send_inline(layer, settings)
        # Every process's member is named alike (``realtime.<hex>``), so one capacity.
        self._member_capacity = int(layer.get_capacity("realtime.member")) if self.inline_group_send else 0
        self._over: set[str] = set()  # channels whose group has a process over capacity
        self._read_kept = self.redis.register_script(_READ_KEPT)
        self.process_channel: str | None = None
        self._receive_errors: set[type[BaseException]] = set()  # logged once per kind
        self._run_id: str | None = None
        self._receiver: asyncio.Task[None] | None = None

    def key(self, kind: str, channel: str) -> str:
        return f"{self.prefix}:{kind}:{group_name(channel)}"

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, deliver: Deliver) -> None:
        # The process's member of each group is a general channel of its own, popped here
        # and nowhere else: channels-redis' ``receive`` costs four round trips a message
        # (its in-flight backup) where one ``BZPOPMIN`` does, and nothing is lost by not
        # keeping a backup — the receiver is only cancelled when the process stops.
        self.process_channel = f"realtime.{uuid.uuid4().hex}"
        self._receiver = asyncio.get_running_loop().create_task(self._receive(deliver), name="realtime-receive")

    async def stop(self) -> None:
        receiver, self._receiver = self._receiver, None
        await cancel_and_wait(receiver)
        await self.redis.aclose(close_connection_pool=self._owns_pool or None)

    async def _pop(self) -> Any:
        """The next message of this process's channel (``None`` after an idle wait)."""
        assert self.process_channel is not None
        layer = self.layer
        connection = layer.connection(layer.consistent_hash(self.process_channel))
        popped = await connection.bzpopmin(layer.prefix + self.process_channel, timeout=layer.brpop_timeout)
        return None if popped is None else layer.deserialize(popped[1])

    async def _receive(self, deliver: Deliver) -> None:
        while True:
            try:
                message = await self._pop()
            except asyncio.CancelledError:
                raise
            except RedisTimeout:
                continue  # an idle blocking pop outliving the socket timeout: not an outage
            except self.errors as exc:
                self.outage.failed(exc)
                await asyncio.sleep(0.5)
                continue
            except Exception as exc:  # a message it cannot decode...: never stop receiving
                if type(exc) not in self._receive_errors:
                    self._receive_errors.add(type(exc))
                    logger.exception("receiving from the backplane failed; going on")
                await asyncio.sleep(0.1)
                continue
            if message is None:
                continue
            kind = message.get("type")
            try:
                if kind == FRAME:
                    await deliver(
                        Delivery(
                            "frame",
                            message["channel"],
                            message["text"],
                            int(message.get("seq", 0)),
                            str(message.get("epoch", "")),
                        )
                    )
                elif kind == RELEASED and message.get("by") != self.instance_id:
                    await deliver(Delivery("released", message["channel"]))
            except asyncio.CancelledError:
                raise
            except Exception:  # a delivery must never stop this process's receiving
                logger.exception("delivering a backplane message failed")

    async def check(self) -> bool:
        """False when the sentinel key vanished (restart, flush, eviction; and every
        ``REASSERT_INTERVAL_MS``) or Redis' ``run_id`` changed (a restart that restored a
        snapshot brings the sentinel back, not what happened since)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.prefix}:alive:{self.instance_id}", 1, nx=True, px=self.reassert_ms)
            pipe.info("server")
            created, info = await pipe.execute()
        run_id, self._run_id = self._run_id, str(info.get("run_id", ""))
        return not created and run_id in (None, self._run_id)

    # -- groups and publications -----------------------------------------------------

    async def join(self, channels: list[str]) -> None:
        assert self.process_channel is not None
        layer = self.layer
        shards: dict[int, list[bytes]] = {}
        for channel in channels:
            group = group_name(channel)
            shards.setdefault(layer.consistent_hash(group), []).append(layer._group_key(group))
        now = time.time()
        async with self._slots:
            for index, keys in shards.items():
                async with layer.connection(index).pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.zadd(key, {self.process_channel: now})
                        pipe.expire(key, layer.group_expiry)
                    await pipe.execute()

    async def leave(self, channel: str) -> None:
        assert self.process_channel is not None
        async with self._slots:
            await self.layer.group_discard(group_name(channel), self.process_channel)

    def _kept_keys(self, channel: str) -> list[str]:
        return [
            self.key("seq", channel),
            self.key("epoch", channel),
            self.key("history", channel),
            self.key("history-largest", channel),
        ]

    def _group_send_args(self, channel: str) -> list[Any]:
        """ARGV of the group send done by the publishing script (see ``_GROUP_SEND``)."""
        layer = self.layer
        length = layer._serializer.random_prefix_length
        return [
            layer.prefix,
            layer.group_expiry,
            int(layer.expiry),
            self._member_capacity,
            random.getrandbits(8 * length).to_bytes(length, "big"),
            channel,
        ]

    def _over_capacity(self, channel: str, over: Any) -> None:
        """Log once when processes of ``channel``'s group start missing its frames (their
        layer channel is full: they fall behind) and once when none does any more."""
        if int(over) and channel not in self._over:
            self._over.add(channel)
            logger.warning(
                "%s member(s) of group %s are over the layer's capacity and miss frames "
                "(a process that falls behind, or one that stopped without leaving the group)",
                int(over),
                group_name(channel),
            )
        elif not int(over) and channel in self._over:
            self._over.discard(channel)
            logger.warning("every process of group %s takes frames again", group_name(channel))

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        ts = now_ms()
        head = notification_head(channel, data_json)
        inline = self.inline_group_send
        group = [self.layer._group_key(group_name(channel))] if inline else []
        send = self._group_send_args(channel) if inline else []
        message: dict[str, Any] = {"type": FRAME, "channel": channel}
        if history is None:
            if inline:
                seq_, over = await self._publish(
                    keys=[self.key("seq", channel), *group], args=[floor, self.seq_ttl_ms, head, ts, *send]
                )
                self._over_capacity(channel, over)
                return int(seq_)
            seq = int(await self._seq(keys=[self.key("seq", channel)], args=[floor, self.seq_ttl_ms]))
            text = head + notification_tail(seq, ts)
        else:
            keep = max(self.seq_ttl_ms, history.ttl_ms, KEEP_LINEAGE_MS)
            seq_, epoch_, over = await self._publish_kept(
                keys=[*self._kept_keys(channel), *group],
                args=[epoch_suffix(), keep, floor, head, ts, history.size, history.ttl_ms, *send],
            )
            seq, epoch = int(seq_), _text(epoch_)
            seen, kept = self.histories.get(channel, ("", 0))  # counted exactly at each read
            self.histories[channel] = (epoch, min(history.size, kept + 1) if seen == epoch else 1)
            if inline:
                self._over_capacity(channel, over)
                return seq
            text = head + notification_tail(seq, ts, epoch)
            message["epoch"] = epoch
        message.update(text=text, seq=seq)
        async with self._slots:
            await self.layer.group_send(group_name(channel), message)
        return seq

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        keep = max(self.seq_ttl_ms, policy.ttl_ms, KEEP_LINEAGE_MS)
        epoch_, top, size, raw = await self._read_kept(
            keys=self._kept_keys(channel),
            args=[
                epoch_suffix(),
                keep,
                since.seq if since else -1,
                since.epoch if since else "",
                policy.size,
                PAGE,
                floor,
                PAGE_BYTES,
            ],
        )
        epoch = _text(epoch_)
        self.histories[channel] = (epoch, int(size))
        return HistoryRead(epoch, int(top), int(size), _entries(raw))

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        keys = [self.key("history", channel), self.key("history-largest", channel)]
        return _entries(await self._read_page(keys=keys, args=[after, count, max_bytes]))

    async def reseed(self, floors: dict[str, int]) -> None:
        if not floors:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for channel, floor in floors.items():
                await self._reseed(keys=[self.key("seq", channel)], args=[floor, self.seq_ttl_ms], client=pipe)
            await pipe.execute()

    # -- leases -----------------------------------------------------------------------

    async def acquire(self, channel: str) -> bool:
        return bool(await self.redis.set(self.key("lease", channel), self.instance_id, nx=True, px=self.lease_ttl_ms))

    async def renew(self, channel: str) -> bool:
        return bool(await self._renew(keys=[self.key("lease", channel)], args=[self.instance_id, self.lease_ttl_ms]))

    async def release(self, channel: str) -> None:
        await self._release(keys=[self.key("lease", channel)], args=[self.instance_id])
        async with self._slots:
            await self.layer.group_send(
                group_name(channel), {"type": RELEASED, "channel": channel, "by": self.instance_id}
            )

    async def lease_holder(self, channel: str) -> str | None:
        value = await self.redis.get(self.key("lease", channel))
        return value.decode() if isinstance(value, bytes) else value

    # -- probes -----------------------------------------------------------------------

    async def put_probe(self, probe: dict[str, Any], ttl_ms: int) -> None:
        now = now_ms()
        instances = f"{self.prefix}:instances"
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.prefix}:probe:{self.instance_id}", json.dumps(probe), px=ttl_ms)
            pipe.zadd(instances, {self.instance_id: now + ttl_ms})
            pipe.zremrangebyscore(instances, "-inf", now)
            pipe.pexpire(instances, ttl_ms)  # gone with the last live process's probe
            await pipe.execute()

    async def drop_probe(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(f"{self.prefix}:probe:{self.instance_id}", f"{self.prefix}:alive:{self.instance_id}")
            pipe.zrem(f"{self.prefix}:instances", self.instance_id)
            await pipe.execute()

    async def cluster_probes(self) -> list[dict[str, Any]]:
        ids = await self.redis.zrangebyscore(f"{self.prefix}:instances", now_ms(), "+inf")
        if not ids:
            return []
        names = [i.decode() if isinstance(i, bytes) else i for i in ids]
        raw = await self.redis.mget([f"{self.prefix}:probe:{n}" for n in names])
        return [json.loads(r) for r in raw if r]

    # -- admission ----------------------------------------------------------------------

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        refill_ms = int(capacity / refill_per_s * 1000) + 1000  # a full bucket needs no key
        wait = await self._take(
            keys=[f"{self.prefix}:bucket:{identity}"], args=[repr(cost), repr(capacity), repr(refill_per_s), refill_ms]
        )
        seconds = float(wait.decode() if isinstance(wait, bytes) else wait)
        return retry_after_ms(seconds) if seconds > 0 else None


def _entries(raw: list[Any]) -> list[HistoryEntry]:
    """Stream entries ``[id, [field, value, …]]`` as :class:`HistoryEntry`."""
    entries = []
    for entry_id, values in raw:
        if isinstance(values, dict):
            fields = {_text(k): v for k, v in values.items()}
        else:
            fields = {_text(k): v for k, v in zip(values[::2], values[1::2], strict=True)}
        seq = int(_text(entry_id).partition("-")[0])
        entries.append(HistoryEntry(seq, int(fields["ts"]), _text(fields["t"])))
    return entries


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _client(layer: Any, settings: dict[str, Any]) -> Any:
    """A redis.asyncio client with a *blocking* pool (a burst waits for a connection
    instead of failing) on ``REDIS_URL`` or the layer's first host."""
    url = settings["REDIS_URL"] or dict(layer.hosts[0]).get("address")
    if not url:  # a sentinel or keyword host: the layer's own kind of pool
        from channels_redis.utils import create_pool

        return aioredis.Redis(connection_pool=create_pool(layer.hosts[0]))
    timeout_s = settings["REDIS_TIMEOUT_MS"] / 1000
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=settings["REDIS_MAX_CONNECTIONS"],
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    return aioredis.Redis(connection_pool=pool)
