"""The Redis backplane's Lua scripts: each runs atomically in Redis, so a publication is
numbered, kept and published in one round trip, a lease is renewed or released only by
its holder, and a shared bucket is refilled with Redis' own clock."""

from __future__ import annotations

from typing import Any

__all__ = [
    "KEEP_LINEAGE_MS",
    "for_cluster",
    "text",
    "PRESENCE_ALIVE",
    "PRESENCE_PUT",
    "PRESENCE_READ",
    "PUBLISH",
    "PUBLISH_KEPT",
    "READ_KEEP_MIN_MS",
    "READ_KEPT",
    "READ_PAGE",
    "RELEASE",
    "RENEW",
    "RESEED",
    "SEQ",
    "TAKE",
]


# Keep the lease, or take it again if it vanished (Redis restarted empty): the holder
# keeps its ticker across a restart instead of stopping and starting it.
RENEW = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""
# KEYS: lease, Redis channel; ARGV: this process. The others learn at once that it is free.
RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1])
  redis.call('publish', KEYS[2], 'r 0 - ' .. ARGV[1])
  return 1
end
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
SEQ = _NUMBER + "return v\n"
# A message on a channel's Redis channel: ``f <seq> <epoch or -> <notification text>`` (a
# frame), or ``r 0 - <instance>`` (that process released the channel's lease).
# KEYS: seq, Redis channel; ARGV: floor, keep ms, head, ts
PUBLISH = (
    _NUMBER
    + """
local s = string.format('%d', v)
local text = ARGV[3] .. ',"seq":' .. s .. ',"ts":' .. ARGV[4] .. '}}'
redis.call('publish', KEYS[2], 'f ' .. s .. ' - ' .. text)
return v
"""
)
RESEED = """
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
local previous = nil
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
if not epoch or (owner ~= run and owner ~= previous) or not top then renew() end
local restamp = owner ~= run  -- the data came through a failover: the epoch goes on, owned anew
"""
# KEYS: seq, epoch, stream, largest entry, Redis channel; ARGV: new epoch, keep ms, floor,
# head, ts, size, ttl ms
PUBLISH_KEPT = (
    _LINEAGE
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
if renewed or restamp or v ~= incremented or redis.call('pttl', KEYS[1]) < tonumber(ARGV[2]) / 2 then
  redis.call('set', KEYS[1], s, 'PX', ARGV[2])  -- INCR keeps the TTL: set it now and then
  redis.call('set', KEYS[2], epoch .. ' ' .. run, 'PX', ARGV[2])
end
redis.call('pexpire', KEYS[3], ARGV[7])
local size = string.len(text)  -- the largest entry bounds each read's bytes (_PAGE)
if size > tonumber(redis.call('get', KEYS[4]) or '0') then redis.call('set', KEYS[4], size) end
redis.call('pexpire', KEYS[4], ARGV[7])
redis.call('publish', KEYS[5], 'f ' .. s .. ' ' .. epoch .. ' ' .. text)
return {v, epoch}
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
READ_PAGE = _PAGE + "return page(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))\n"
# KEYS: seq, epoch, stream, largest entry; ARGV: new epoch, keep ms (unused: a read never
# keeps a lineage longer than its history), since (-1: none), its epoch, size, page, floor,
# page bytes, read ms. A read (a subscribe: anyone's) keeps the count and epoch at least
# ``read ms`` (the channel's own history TTL) and never longer than a publication made
# them live: a fresh channel's lineage costs its history's TTL, not a day.
READ_KEPT = (
    _LINEAGE
    + _PAGE
    + """
top = math.max(tonumber(top or '0'), tonumber(ARGV[7]))
local keep = tonumber(ARGV[9])
if not renewed then keep = math.max(keep, redis.call('pttl', KEYS[2])) end
redis.call('set', KEYS[1], string.format('%d', top), 'PX', keep)
redis.call('set', KEYS[2], epoch .. ' ' .. run, 'PX', keep)
local since = tonumber(ARGV[3])
local entries = {}
if since >= 0 and epoch == ARGV[4] and top > since and top - since <= tonumber(ARGV[5]) then
  entries = page(KEYS[3], KEYS[4], since, tonumber(ARGV[6]), tonumber(ARGV[8]))
end
return {epoch, top, redis.call('xlen', KEYS[3]), entries, renewed and 1 or 0}
"""
)
#: A read keeps a channel's count and epoch at least this long (a history TTL shorter).
READ_KEEP_MIN_MS = 1000
#: How long a channel's count and epoch outlive its last publication (at least):
#: an idle day does not start a new history, so a client back after it is told exactly
#: whether it missed anything.
KEEP_LINEAGE_MS = 86_400_000
# One token bucket shared by the cluster (an identity on several processes), refilled
# lazily with Redis' clock so that the processes' clocks never disagree about it.
TAKE = """
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
# Calls that run once (realtime_app.hub.once): a key holds "r<owner>" while its first call
# runs (a lease's life, renewed by its owner) and "a<answer>" once it answered.
CLAIM_ONCE = """
local v = redis.call('get', KEYS[1])
if not v then
  redis.call('set', KEYS[1], 'r' .. ARGV[1], 'PX', ARGV[2])
  return {'run', ''}
end
if string.sub(v, 1, 1) == 'r' then return {'running', ''} end
return {'answer', string.sub(v, 2)}
"""
KEEP_ONCE = """
local v = redis.call('get', KEYS[1])
if not v or v == 'r' .. ARGV[1] then redis.call('set', KEYS[1], 'a' .. ARGV[2], 'PX', ARGV[3]) end
return 1
"""
RENEW_ONCE = """
if redis.call('get', KEYS[1]) == 'r' .. ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
# A durable channel's outbox row published once (realtime_app.hub.outbox): KEYS[6] holds
# the rows published within the dedupe window (ARGV[8] the row's key, ARGV[9] now, ARGV[10]
# the window, ms); a row seen already is not published again (-1).
PUBLISH_KEPT_ONCE = (
    """
redis.call('zremrangebyscore', KEYS[6], '-inf', tonumber(ARGV[9]) - tonumber(ARGV[10]))
if redis.call('zscore', KEYS[6], ARGV[8]) then return {-1, ''} end
redis.call('zadd', KEYS[6], ARGV[9], ARGV[8])
redis.call('pexpire', KEYS[6], ARGV[10])
"""
    + PUBLISH_KEPT
)

# Presence (realtime_app.wire.presence): KEYS[1] a hash of each process's part (and the
# version, field "~v"), KEYS[2] each process's lease end (a sorted set). Times are Redis'
# own clock (no process's), ms. Parts past their lease are dropped first by every call; a
# version only changes when what a reader sees does, and the next is above both the last
# and now: a reader that holds it reads nothing again. Both keys go with their last part.
PRESENCE_COMMON = """
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function bump()
  local v = tonumber(redis.call('hget', KEYS[1], '~v') or '0')
  redis.call('hset', KEYS[1], '~v', math.max(v + 1, now))
end
-- A part expires at its score; one of a process marked alive ("@" and its id: written
-- with a long score) also goes as soon as that process's alive key (alive .. id) lapses.
local function prune(alive)
  local gone = redis.call('zrangebyscore', KEYS[2], '-inf', now)
  if alive ~= '' then
    for _, who in ipairs(redis.call('zrangebyscore', KEYS[2], '(' .. now, '+inf')) do
      if string.sub(who, 1, 1) == '@' and redis.call('exists', alive .. string.sub(who, 2)) == 0 then
        gone[#gone + 1] = who
      end
    end
  end
  if #gone == 0 then return false end
  for _, who in ipairs(gone) do
    redis.call('hdel', KEYS[1], who)
    redis.call('zrem', KEYS[2], who)
  end
  return true
end
local function empty()
  if redis.call('hlen', KEYS[1]) - redis.call('hexists', KEYS[1], '~v') > 0 then return false end
  redis.call('del', KEYS[1], KEYS[2])
  return true
end
"""
# ARGV: process, part ('' = none left), ttl (ms), alive keys' prefix ('' : none).
PRESENCE_PUT = (
    PRESENCE_COMMON
    + """
local changed = prune(ARGV[4] or '')
local ttl = tonumber(ARGV[3])
if ARGV[2] == '' then
  if redis.call('hdel', KEYS[1], ARGV[1]) == 1 then changed = true end
  redis.call('zrem', KEYS[2], ARGV[1])
elseif redis.call('hget', KEYS[1], ARGV[1]) ~= ARGV[2] then
  redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
  changed = true
end
if ARGV[2] ~= '' then redis.call('zadd', KEYS[2], now + ttl, ARGV[1]) end
if empty() then return 1 end
if changed then bump() end
for _, key in ipairs(KEYS) do  -- never shorter: another process's parts may live longer than this one's
  if redis.call('pttl', key) < ttl then redis.call('pexpire', key, ttl) end
end
return 1
"""
)
# ARGV: the version the reader holds, alive keys' prefix ('' : none).
PRESENCE_READ = (
    PRESENCE_COMMON
    + """
if prune(ARGV[2] or '') and not empty() then bump() end
local v = redis.call('hget', KEYS[1], '~v') or '0'
if v == ARGV[1] then return {v} end
local out = {v}
local all = redis.call('hgetall', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= '~v' then out[#out + 1] = all[i + 1] end
end
return out
"""
)


# A process's presence liveness (one key per process, renewed every beat): whether it was
# still there. KEYS: the alive key; ARGV: ttl (ms).
PRESENCE_ALIVE = """
local was = redis.call('exists', KEYS[1])
redis.call('set', KEYS[1], '1', 'PX', ARGV[1])
return was
"""


#: The line of :data:`_LINEAGE` that names whose data a history is, and what a Redis
#: Cluster node says instead (:func:`for_cluster`).
_RUN = "local run = string.match(redis.call('info', 'server'), 'run_id:(%x+)') or ''\nlocal previous = nil\n"
_REPLICATION = (
    "local replication = redis.call('info', 'replication')\n"
    "local run = string.match(replication, 'master_replid:(%x+)') or ''\n"
    "local previous = string.match(replication, 'master_replid2:(%x+)')\n"
)


def for_cluster(script: str) -> str:
    """``script`` as it runs on a Redis Cluster master (:mod:`realtime_app.cluster.redis_cluster`):
    it publishes with ``SPUBLISH`` (sharded pub/sub: on the channel's own shard, not
    broadcast to every node), and a history belongs to the shard's replication history
    rather than to one server's run: a replica promoted with the data keeps the epoch
    (its previous replication id is the old master's), a server that lost it starts a new one."""
    if _RUN in script:
        script = script.replace(_RUN, _REPLICATION)
    elif "run" in script and "info" in script:
        raise ValueError("a script reads the server's run id in a way for_cluster does not know")
    return script.replace("redis.call('publish',", "redis.call('spublish',")


def text(value: Any) -> str:
    """A Redis reply as text (bytes decoded)."""
    return value.decode() if isinstance(value, bytes) else str(value)
