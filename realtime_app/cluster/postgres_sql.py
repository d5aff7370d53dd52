"""The PostgreSQL backplane's tables and functions: each function runs in one transaction
on the server, so a publication is numbered, kept and notified in one round trip, a lease
is renewed or released only by its holder, and every clock is the database's own.

Created by ``manage.py migrate`` (migration ``0005_postgres_backplane``) on every
PostgreSQL database it migrates; nothing on other databases. Five tables, every row of
which carries its own end (``expires_at``, ms of the database's clock) and is pruned by
:data:`PRUNE` a bounded number of rows at a time:

* ``realtime_app_bp_key`` — small keyed values (leases, probes, alive marks, idempotent
  calls, the outbox's dedupe book, shared token buckets), under a ``scope`` that carries
  ``KEY_PREFIX``;
* ``realtime_app_bp_channel`` — each channel's count, epoch and history window;
* ``realtime_app_bp_history`` — what channels with history keep (``size`` rows at most);
* ``realtime_app_bp_presence`` — each process's part of each presence channel, and its version;
* ``realtime_app_bp_payload`` — publications too large for a ``NOTIFY`` (8,000 bytes), a
  minute each.

A message on a channel's ``NOTIFY`` channel is the Redis backplane's: ``f <seq> <epoch or
-> <text>`` or ``r 0 - <instance>``, and ``p <id>`` for a payload kept in the table.
"""

from __future__ import annotations

__all__ = ["DROP", "INSTALL", "NOTIFY_LIMIT", "PAYLOAD_KEEP_MS", "PRUNE", "PRUNE_BATCH"]

#: The largest message a ``NOTIFY`` carries (PostgreSQL refuses 8,000 bytes and more).
NOTIFY_LIMIT = 7999
#: How long a publication too large for a ``NOTIFY`` stays readable, ms.
PAYLOAD_KEEP_MS = 60_000
#: Rows of each kind a prune deletes at most per call (it never holds locks for long; called
#: again at once while a batch was full).
PRUNE_BATCH = 2000

TABLES = """
CREATE TABLE IF NOT EXISTS realtime_app_bp_key (
  scope text NOT NULL, name text NOT NULL, value text NOT NULL DEFAULT '',
  expires_at bigint NOT NULL, PRIMARY KEY (scope, name));
CREATE INDEX IF NOT EXISTS realtime_app_bp_key_expires ON realtime_app_bp_key (expires_at);
CREATE TABLE IF NOT EXISTS realtime_app_bp_channel (
  name text PRIMARY KEY, seq bigint NOT NULL DEFAULT 0, epoch text NOT NULL DEFAULT '',
  owner text NOT NULL DEFAULT '', largest integer NOT NULL DEFAULT 0,
  expires_at bigint NOT NULL, history_until bigint NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS realtime_app_bp_channel_expires ON realtime_app_bp_channel (expires_at);
CREATE TABLE IF NOT EXISTS realtime_app_bp_history (
  channel text NOT NULL, seq bigint NOT NULL, ts bigint NOT NULL, body text NOT NULL,
  PRIMARY KEY (channel, seq));
CREATE TABLE IF NOT EXISTS realtime_app_bp_presence (
  channel text NOT NULL, member text NOT NULL, part text NOT NULL, expires_at bigint NOT NULL,
  PRIMARY KEY (channel, member));
CREATE INDEX IF NOT EXISTS realtime_app_bp_presence_expires ON realtime_app_bp_presence (expires_at);
CREATE TABLE IF NOT EXISTS realtime_app_bp_payload (
  id bigserial PRIMARY KEY, body text NOT NULL, expires_at bigint NOT NULL);
CREATE UNLOGGED TABLE IF NOT EXISTS realtime_app_bp_run (id int PRIMARY KEY, token text NOT NULL);
"""

# The database's clock (ms), and the server's run: a token kept in an UNLOGGED table, which
# PostgreSQL empties when it recovers from a crash (and keeps across a clean restart). A
# history belongs to one run: the backplane's commits do not wait for the disk
# (synchronous_commit off), so a crash may lose the last of them — a count that went back
# under the same epoch would number two publications alike. A clean restart loses nothing
# and keeps the token: histories go on. (Found: the postmaster's start time, the first
# token, stays the same when a crashed backend makes the server recover.)
CLOCK = """
CREATE OR REPLACE FUNCTION realtime_app_bp_now() RETURNS bigint LANGUAGE sql VOLATILE AS
$$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_run() RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE t text;
BEGIN
  SELECT token INTO t FROM realtime_app_bp_run WHERE id = 1;
  IF t IS NULL THEN
    INSERT INTO realtime_app_bp_run VALUES (1, md5(random()::text || clock_timestamp()::text))
    ON CONFLICT (id) DO NOTHING;
    SELECT token INTO t FROM realtime_app_bp_run WHERE id = 1;
  END IF;
  RETURN t;
END $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_new_epoch(old text, suffix text, now_ bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE ms bigint := now_;
BEGIN
  IF length(old) = 19 THEN  -- never older than the one replaced (a clock behind)
    ms := greatest(ms, ('x' || lpad(substr(old, 1, 11), 16, '0'))::bit(64)::bigint + 1);
  END IF;
  RETURN lpad(to_hex(ms), 11, '0') || suffix;
END $$;
"""

NOTIFY = f"""
CREATE OR REPLACE FUNCTION realtime_app_bp_notify(chan text, msg text, now_ bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE pid bigint;
BEGIN
  IF octet_length(msg) > {NOTIFY_LIMIT} THEN
    INSERT INTO realtime_app_bp_payload (body, expires_at) VALUES (msg, now_ + {PAYLOAD_KEEP_MS}) RETURNING id INTO pid;
    PERFORM pg_notify(chan, 'p ' || pid);
  ELSE
    PERFORM pg_notify(chan, msg);
  END IF;
END $$;
"""

# A publication of a channel without history: the next seq above the publisher's floor (a
# count never goes back, even past its idle end: only the prune forgets it). A row lives at
# least ``keep_ms`` after its last publication; its end (indexed) moves to 1.5 × that only
# when less than that is left: most updates leave the indexed column alone and are HOT
# ones (no new index entry) — at 1,000 publications/s every one added an index entry.
PUBLISH = """
CREATE OR REPLACE FUNCTION realtime_app_bp_publish(k text, chan text, floor_ bigint, keep_ms bigint,
  head text, ts bigint) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v bigint; now_ bigint := realtime_app_bp_now();
BEGIN
  INSERT INTO realtime_app_bp_channel AS c (name, seq, expires_at) VALUES (k, floor_ + 1, now_ + keep_ms * 3 / 2)
  ON CONFLICT (name) DO UPDATE SET seq = greatest(c.seq + 1, floor_ + 1),
    expires_at = CASE WHEN c.expires_at < now_ + keep_ms THEN now_ + keep_ms * 3 / 2 ELSE c.expires_at END
  RETURNING c.seq INTO v;
  PERFORM realtime_app_bp_notify(chan, 'f ' || v || ' - ' || head || ',"seq":' || v || ',"ts":' || ts || '}}', now_);
  RETURN v;
END $$;
"""

# A channel with history (docs/recovery.md): its row, locked, under an epoch of this run of
# the server; a lineage that lapsed, lost its epoch or comes from another run starts anew.
LINEAGE = """
CREATE OR REPLACE FUNCTION realtime_app_bp_lineage(k text, suffix text, now_ bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE c realtime_app_bp_channel; renewed boolean;
BEGIN
  LOOP  -- a prune may take the row between the insert and the lock: again
    INSERT INTO realtime_app_bp_channel (name, expires_at) VALUES (k, 0) ON CONFLICT (name) DO NOTHING;
    SELECT * INTO c FROM realtime_app_bp_channel WHERE name = k FOR UPDATE;
    EXIT WHEN FOUND;
  END LOOP;
  renewed := c.epoch = '' OR c.owner <> realtime_app_bp_run() OR c.expires_at <= now_;
  IF renewed THEN
    DELETE FROM realtime_app_bp_history WHERE channel = k;
    UPDATE realtime_app_bp_channel SET epoch = realtime_app_bp_new_epoch(c.epoch, suffix, now_),
      owner = realtime_app_bp_run(), largest = 0, history_until = 0 WHERE name = k;
  ELSIF c.history_until <= now_ AND c.largest > 0 THEN  -- the history expired; the lineage goes on
    DELETE FROM realtime_app_bp_history WHERE channel = k;
    UPDATE realtime_app_bp_channel SET largest = 0 WHERE name = k;
  END IF;
  RETURN renewed;
END $$;
"""

PUBLISH_KEPT = """
CREATE OR REPLACE FUNCTION realtime_app_bp_publish_kept(k text, chan text, suffix text, keep_ms bigint,
  floor_ bigint, head text, ts_ bigint, size_ int, ttl_ms bigint, OUT seq bigint, OUT epoch text)
LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); c realtime_app_bp_channel; v bigint; e text; body_ text;
BEGIN
  PERFORM realtime_app_bp_lineage(k, suffix, now_);
  SELECT * INTO c FROM realtime_app_bp_channel WHERE name = k;
  v := greatest(c.seq + 1, floor_ + 1);
  e := c.epoch;
  IF EXISTS (SELECT 1 FROM realtime_app_bp_history h WHERE h.channel = k AND h.seq >= v) THEN
    e := realtime_app_bp_new_epoch(e, suffix, now_);  -- the history outlived the count
    c.largest := 0;
    DELETE FROM realtime_app_bp_history h WHERE h.channel = k;
  END IF;
  body_ := head || ',"seq":' || v || ',"epoch":"' || e || '","ts":' || ts_ || '}}';
  INSERT INTO realtime_app_bp_history VALUES (k, v, ts_, body_);
  DELETE FROM realtime_app_bp_history h WHERE h.channel = k AND h.seq <= v - size_;
  UPDATE realtime_app_bp_channel ch SET seq = v, epoch = e, largest = greatest(c.largest, octet_length(body_)),
    history_until = now_ + ttl_ms,
    expires_at = CASE WHEN c.expires_at < now_ + keep_ms THEN now_ + keep_ms * 3 / 2 ELSE c.expires_at END
  WHERE ch.name = k;
  PERFORM realtime_app_bp_notify(chan, 'f ' || v || ' ' || e || ' ' || body_, now_);
  seq := v;
  epoch := e;
END $$;
"""

# A page of a history after ``after``: ``count`` entries at most, no more than ``budget``
# bytes of text but at least one; nothing when the history expired.
PAGE = """
CREATE OR REPLACE FUNCTION realtime_app_bp_page(k text, after_ bigint, count_ int, budget int)
RETURNS TABLE (seq bigint, ts bigint, body text) LANGUAGE sql STABLE AS $$
  SELECT s.seq, s.ts, s.body FROM (
    SELECT h.seq, h.ts, h.body, sum(octet_length(h.body)) OVER (ORDER BY h.seq) AS used,
      row_number() OVER (ORDER BY h.seq) AS n
    FROM (SELECT * FROM realtime_app_bp_history h0 WHERE h0.channel = k AND h0.seq > after_
          AND EXISTS (SELECT 1 FROM realtime_app_bp_channel c
                      WHERE c.name = k AND c.history_until > realtime_app_bp_now())
          ORDER BY h0.seq LIMIT count_) h
  ) s WHERE s.n = 1 OR s.used <= budget ORDER BY s.seq
$$;
"""

# A read (a subscribe: anyone's) keeps the count and epoch at least ``read_ms`` and never
# longer than a publication made them live: a fresh channel costs its history's TTL.
READ_KEPT = """
CREATE OR REPLACE FUNCTION realtime_app_bp_read_kept(k text, suffix text, since_ bigint, since_epoch text,
  size_ int, page_ int, floor_ bigint, page_bytes int, read_ms bigint,
  OUT epoch text, OUT top bigint, OUT kept bigint, OUT created boolean,
  OUT seqs bigint[], OUT stamps bigint[], OUT bodies text[]) LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); c realtime_app_bp_channel; keep bigint := read_ms;
BEGIN
  created := realtime_app_bp_lineage(k, suffix, now_);
  SELECT * INTO c FROM realtime_app_bp_channel ch WHERE ch.name = k;
  top := greatest(c.seq, floor_);
  IF NOT created THEN keep := greatest(keep, c.expires_at - now_); END IF;
  UPDATE realtime_app_bp_channel ch SET seq = top, expires_at = now_ + keep WHERE ch.name = k;
  epoch := c.epoch;
  SELECT count(*) INTO kept FROM realtime_app_bp_history h WHERE h.channel = k;
  IF since_ >= 0 AND c.epoch = since_epoch AND top > since_ AND top - since_ <= size_ THEN
    SELECT array_agg(p.seq), array_agg(p.ts), array_agg(p.body) INTO seqs, stamps, bodies
    FROM realtime_app_bp_page(k, since_, page_, page_bytes) p;
  END IF;
END $$;
"""

RESEED = """
CREATE OR REPLACE FUNCTION realtime_app_bp_reseed(ks text[], floors bigint[], keep_ms bigint) RETURNS void
LANGUAGE sql AS $$
  INSERT INTO realtime_app_bp_channel AS c (name, seq, expires_at)
  SELECT k, f, realtime_app_bp_now() + keep_ms FROM unnest(ks, floors) AS t(k, f) ORDER BY k
  ON CONFLICT (name) DO UPDATE SET seq = greatest(c.seq, excluded.seq),
    expires_at = greatest(c.expires_at, excluded.expires_at)
$$;
"""

# A keyed value written for ``ttl`` ms: whether it was there (and not past its end) before.
KEYS = """
CREATE OR REPLACE FUNCTION realtime_app_bp_put(scope_ text, name_ text, value_ text, ttl bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); was boolean;
BEGIN
  SELECT expires_at > now_ INTO was FROM realtime_app_bp_key WHERE scope = scope_ AND name = name_ FOR UPDATE;
  INSERT INTO realtime_app_bp_key AS x VALUES (scope_, name_, value_, now_ + ttl)
  ON CONFLICT (scope, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at;
  RETURN coalesce(was, false);
END $$;
-- Written only when absent or past its end (SET NX PX): whether it was there. Atomic against
-- a concurrent writer (the second waits for the first's commit, then finds it there).
CREATE OR REPLACE FUNCTION realtime_app_bp_put_new(scope_ text, name_ text, value_ text, ttl bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); took boolean;
BEGIN
  INSERT INTO realtime_app_bp_key AS x VALUES (scope_, name_, value_, now_ + ttl)
  ON CONFLICT (scope, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
  WHERE x.expires_at <= now_
  RETURNING true INTO took;
  RETURN NOT coalesce(took, false);
END $$;
-- Take a lease (or keep it, ``mine``), unless another process holds it.
CREATE OR REPLACE FUNCTION realtime_app_bp_lease(scope_ text, name_ text, holder text, ttl bigint, mine boolean)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); got boolean;
BEGIN
  INSERT INTO realtime_app_bp_key AS x VALUES (scope_, name_, holder, now_ + ttl)
  ON CONFLICT (scope, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
  WHERE x.expires_at <= now_ OR (mine AND x.value = holder)
  RETURNING true INTO got;
  RETURN coalesce(got, false);
END $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_release(scope_ text, name_ text, holder text, chan text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM realtime_app_bp_key WHERE scope = scope_ AND name = name_ AND value = holder;
  IF NOT FOUND THEN RETURN false; END IF;
  PERFORM pg_notify(chan, 'r 0 - ' || holder);  -- the others learn at once that it is free
  RETURN true;
END $$;
"""

# One token bucket shared by the cluster, refilled lazily with the database's clock.
TAKE = """
CREATE OR REPLACE FUNCTION realtime_app_bp_take(scope_ text, name_ text, cost float8, cap float8, rate float8,
  keep_ms bigint) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); t float8 := now_ / 1000.0; v text; tokens float8; stamp float8;
  wait float8 := 0;
BEGIN
  INSERT INTO realtime_app_bp_key VALUES (scope_, name_, '', now_ + keep_ms) ON CONFLICT DO NOTHING;
  SELECT CASE WHEN expires_at > now_ THEN value ELSE '' END INTO v FROM realtime_app_bp_key
  WHERE scope = scope_ AND name = name_ FOR UPDATE;
  IF v = '' THEN tokens := cap; stamp := t;
  ELSE tokens := split_part(v, ' ', 1)::float8; stamp := split_part(v, ' ', 2)::float8; END IF;
  tokens := least(cap, tokens + greatest(0, t - stamp) * rate);
  IF tokens >= cost THEN tokens := tokens - cost; ELSE wait := (cost - tokens) / rate; END IF;
  UPDATE realtime_app_bp_key SET value = tokens::text || ' ' || t::text, expires_at = now_ + keep_ms
  WHERE scope = scope_ AND name = name_;
  RETURN wait;
END $$;
"""

# Calls that run once (realtime_app.hub.once): a key holds "r<owner>" while its first call
# runs (a lease's life, renewed by its owner) and "a<answer>" once it answered.
ONCE = """
CREATE OR REPLACE FUNCTION realtime_app_bp_claim_once(scope_ text, name_ text, owner_ text, ttl bigint,
  OUT state text, OUT answer text) LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); v text;
BEGIN
  answer := '';
  INSERT INTO realtime_app_bp_key AS x VALUES (scope_, name_, 'r' || owner_, now_ + ttl)
  ON CONFLICT (scope, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
  WHERE x.expires_at <= now_ RETURNING value INTO v;
  IF v IS NOT NULL THEN state := 'run'; RETURN; END IF;
  SELECT value INTO v FROM realtime_app_bp_key WHERE scope = scope_ AND name = name_;
  IF left(v, 1) = 'r' THEN state := 'running'; ELSE state := 'answer'; answer := substr(v, 2); END IF;
END $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_keep_once(scope_ text, name_ text, owner_ text, answer text, ttl bigint)
RETURNS void LANGUAGE sql AS $$
  INSERT INTO realtime_app_bp_key AS x VALUES (scope_, name_, 'a' || answer, realtime_app_bp_now() + ttl)
  ON CONFLICT (scope, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
  WHERE x.value = 'r' || owner_ OR x.expires_at <= realtime_app_bp_now()
$$;
CREATE OR REPLACE FUNCTION realtime_app_bp_renew_once(scope_ text, name_ text, owner_ text, ttl bigint)
RETURNS void LANGUAGE sql AS $$
  UPDATE realtime_app_bp_key SET expires_at = realtime_app_bp_now() + ttl
  WHERE scope = scope_ AND name = name_ AND value = 'r' || owner_ AND expires_at > realtime_app_bp_now()
$$;
-- A durable channel's outbox row published once within the dedupe window: -1 when it was.
CREATE OR REPLACE FUNCTION realtime_app_bp_publish_kept_once(k text, chan text, suffix text, keep_ms bigint,
  floor_ bigint, head text, ts bigint, size_ int, ttl_ms bigint, done_scope text, row_key text, window_ms bigint,
  OUT seq bigint, OUT epoch text) LANGUAGE plpgsql AS $$
BEGIN
  IF realtime_app_bp_put_new(done_scope, row_key, '', window_ms) THEN seq := -1; epoch := ''; RETURN; END IF;
  SELECT * INTO seq, epoch FROM realtime_app_bp_publish_kept(k, chan, suffix, keep_ms, floor_, head, ts, size_, ttl_ms);
END $$;
"""

# Presence (realtime_app.wire.presence): a row per process's part, and the version (member
# "~v", its end the longest part's). Parts past their end go first; so do the parts of a
# process marked alive ("@" and its id) whose alive mark lapsed. A version changes only
# when what a reader sees does, and the next is above both the last and now.
PRESENCE = """
CREATE OR REPLACE FUNCTION realtime_app_bp_presence_prune(k text, alive text, now_ bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM realtime_app_bp_presence p WHERE p.channel = k AND p.member <> '~v' AND (p.expires_at <= now_
    OR (alive <> '' AND left(p.member, 1) = '@' AND NOT EXISTS (SELECT 1 FROM realtime_app_bp_key a
        WHERE a.scope = alive AND a.name = substr(p.member, 2) AND a.expires_at > now_)));
  RETURN FOUND;
END $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_presence_settle(k text, changed boolean, now_ bigint, ttl bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM realtime_app_bp_presence WHERE channel = k AND member <> '~v') THEN
    DELETE FROM realtime_app_bp_presence WHERE channel = k;  -- gone with its last part
  ELSIF changed THEN
    UPDATE realtime_app_bp_presence SET part = greatest(part::bigint + 1, now_)::text,
      expires_at = greatest(expires_at, now_ + ttl) WHERE channel = k AND member = '~v';
  ELSE
    UPDATE realtime_app_bp_presence SET expires_at = greatest(expires_at, now_ + ttl)
    WHERE channel = k AND member = '~v';
  END IF;
END $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_presence_put(k text, member_ text, part_ text, ttl bigint, alive text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); changed boolean; old text;
BEGIN
  LOOP  -- one writer a room; the row waited for may have gone with the room's last part: again
    INSERT INTO realtime_app_bp_presence VALUES (k, '~v', '0', now_ + ttl) ON CONFLICT DO NOTHING;
    PERFORM 1 FROM realtime_app_bp_presence WHERE channel = k AND member = '~v' FOR UPDATE;
    EXIT WHEN FOUND;
  END LOOP;
  changed := realtime_app_bp_presence_prune(k, alive, now_);
  SELECT part INTO old FROM realtime_app_bp_presence WHERE channel = k AND member = member_;
  IF part_ = '' THEN
    DELETE FROM realtime_app_bp_presence WHERE channel = k AND member = member_;
    changed := changed OR FOUND;
  ELSE
    INSERT INTO realtime_app_bp_presence AS p VALUES (k, member_, part_, now_ + ttl)
    ON CONFLICT (channel, member) DO UPDATE SET part = excluded.part, expires_at = excluded.expires_at;
    changed := changed OR old IS DISTINCT FROM part_;
  END IF;
  PERFORM realtime_app_bp_presence_settle(k, changed, now_, CASE WHEN part_ = '' THEN 0 ELSE ttl END);
END $$;
CREATE OR REPLACE FUNCTION realtime_app_bp_presence_read(k text, known text, alive text,
  OUT version text, OUT parts text[]) LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now();
BEGIN
  -- Locked and written only when a part has to go (past its end, or its process's mark
  -- lapsed): a read of a room where nothing changed writes nothing (20,000 idle rooms
  -- read each interval would otherwise lock and dirty 20,000 rows a second).
  IF EXISTS (SELECT 1 FROM realtime_app_bp_presence p WHERE p.channel = k AND p.member <> '~v'
             AND (p.expires_at <= now_ OR (alive <> '' AND left(p.member, 1) = '@' AND NOT EXISTS (
               SELECT 1 FROM realtime_app_bp_key a WHERE a.scope = alive AND a.name = substr(p.member, 2)
               AND a.expires_at > now_)))) THEN
    PERFORM 1 FROM realtime_app_bp_presence WHERE channel = k AND member = '~v' FOR UPDATE;
    IF realtime_app_bp_presence_prune(k, alive, now_) THEN
      PERFORM realtime_app_bp_presence_settle(k, true, now_, 0);
    END IF;
  END IF;
  SELECT part INTO version FROM realtime_app_bp_presence WHERE channel = k AND member = '~v';
  version := coalesce(version, '0');
  IF version <> known THEN
    SELECT coalesce(array_agg(part ORDER BY member), '{}') INTO parts FROM realtime_app_bp_presence
    WHERE channel = k AND member <> '~v';
  END IF;
END $$;
"""

#: Everything the backplane needs, idempotent (``migrate`` runs it; so may a test).
INSTALL = TABLES + CLOCK + NOTIFY + PUBLISH + LINEAGE + PUBLISH_KEPT + PAGE + READ_KEPT + RESEED + KEYS + TAKE
INSTALL += ONCE + PRESENCE

#: Undone by the migration's reverse: the tables and every function (found: a rollback that
#: left the functions made the backplane start, then fail each call on a missing table).
DROP = """
DO $$ DECLARE f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
           WHERE left(p.proname, 16) = 'realtime_app_bp_' AND p.pronamespace = current_schema()::regnamespace LOOP
    EXECUTE 'DROP FUNCTION IF EXISTS ' || f || ' CASCADE';
  END LOOP;
END $$;
DROP TABLE IF EXISTS realtime_app_bp_key, realtime_app_bp_history, realtime_app_bp_presence,
  realtime_app_bp_payload, realtime_app_bp_run CASCADE;
DROP TABLE IF EXISTS realtime_app_bp_channel CASCADE;
"""

# Rows past their end, at most ``batch`` of each kind per call (the caller calls again while
# a batch was full). Never waits for a lock (SKIP LOCKED: a row in use is left for the next
# prune, and no prune can deadlock with a publication or a presence write), and deletes by
# ctid: a row renewed meanwhile is a new version, left alone. A channel's history goes when
# its history expired (``largest`` > 0 marks one that holds rows) or with its channel.
PRUNE_FUNCTION = """
CREATE OR REPLACE FUNCTION realtime_app_bp_prune(batch int) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE now_ bigint := realtime_app_bp_now(); n bigint; total bigint := 0; ch text;
BEGIN
  DELETE FROM realtime_app_bp_key WHERE ctid = ANY (ARRAY(SELECT ctid FROM realtime_app_bp_key
    WHERE expires_at <= now_ LIMIT batch FOR UPDATE SKIP LOCKED));
  GET DIAGNOSTICS n = ROW_COUNT; total := total + n;
  DELETE FROM realtime_app_bp_payload WHERE ctid = ANY (ARRAY(SELECT ctid FROM realtime_app_bp_payload
    WHERE expires_at <= now_ LIMIT batch FOR UPDATE SKIP LOCKED));
  GET DIAGNOSTICS n = ROW_COUNT; total := total + n;
  FOR ch IN SELECT name FROM realtime_app_bp_channel WHERE expires_at <= now_ LIMIT batch
      FOR UPDATE SKIP LOCKED LOOP
    DELETE FROM realtime_app_bp_history WHERE channel = ch;
    DELETE FROM realtime_app_bp_channel WHERE name = ch;
    total := total + 1;
  END LOOP;
  FOR ch IN SELECT name FROM realtime_app_bp_channel WHERE largest > 0 AND history_until <= now_
      LIMIT batch FOR UPDATE SKIP LOCKED LOOP
    DELETE FROM realtime_app_bp_history WHERE channel = ch;
    UPDATE realtime_app_bp_channel SET largest = 0 WHERE name = ch;
    total := total + 1;
  END LOOP;
  -- a room whose version row is past its end has no part left alive (the version outlives
  -- every part); rows renewed meanwhile are new versions, left alone
  DELETE FROM realtime_app_bp_presence WHERE ctid = ANY (ARRAY(
    SELECT p.ctid FROM realtime_app_bp_presence p JOIN realtime_app_bp_presence v
      ON v.channel = p.channel AND v.member = '~v'
    WHERE v.expires_at <= now_ AND p.expires_at <= now_ LIMIT batch FOR UPDATE OF p SKIP LOCKED));
  GET DIAGNOSTICS n = ROW_COUNT; total := total + n;
  RETURN total;
END $$;
"""

INSTALL += PRUNE_FUNCTION

#: One prune: a batch of each kind (:func:`realtime_app_bp_prune`); how many rows went.
PRUNE = f"SELECT realtime_app_bp_prune({PRUNE_BATCH})"
