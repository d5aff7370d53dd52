// realtime_app browser client: JSON-RPC 2.0 over WebSocket, subscriptions with automatic
// resubscription, capped jittered reconnect, and adaptive cadence (AIMD) bound by
// make-before-break; delta subscriptions. ES module, no build step; one vendored module,
// the Fossil delta codec (vendor/fossil-delta.js, BSD).
// The Python twin is realtime_app/client/adaptive.py; both pass tests/vectors/adaptive.json.
import { applyDelta } from "./vendor/fossil-delta.js";

const UTF8 = new TextEncoder();
const UTF8_STRICT = new TextDecoder("utf-8", { fatal: true });

/** Close codes after which the client reconnects (with backoff). 1008 and 4xxx are fatal. */
export const RECONNECT_CODES = Object.freeze([1001, 1005, 1006, 1011, 1012, 1013]);

/** @param {number} code @returns {boolean} */
export function isReconnectableCloseCode(code) {
  return RECONNECT_CODES.includes(code);
}

/**
 * The `ticket=<t>` of a draining server's 1012 close reason, if any: shown on the next
 * handshake, it is not refused as a crowd's (realtime_app.endpoint.tickets).
 * @param {string} reason @returns {string | undefined}
 */
export function reconnectTicket(reason) {
  const match = /(?:^|\s)ticket=([A-Za-z0-9_:-]{1,100})(?:\s|$)/.exec(reason || "");
  return match ? match[1] : undefined;
}

/** `url` with `ticket=<ticket>` in its query, in place of any it had (as given without one).
 * @param {string} url @param {string} [ticket] */
export function withTicket(url, ticket) {
  if (!ticket) return url;
  const hash = url.indexOf("#");
  const head = hash < 0 ? url : url.slice(0, hash);
  const fragment = hash < 0 ? "" : url.slice(hash);
  const mark = head.indexOf("?");
  const path = mark < 0 ? head : head.slice(0, mark);
  const kept = mark < 0 ? [] : head.slice(mark + 1).split("&").filter((part) => part && !part.startsWith("ticket="));
  return `${path}?${[...kept, `ticket=${encodeURIComponent(ticket)}`].join("&")}${fragment}`;
}

/**
 * Name the channel of `base` at cadence `ms`: `base` at the family default, else `base:ms`.
 * @param {string} base @param {number} ms @param {number} [defaultMs]
 */
export function rateChannel(base, ms, defaultMs) {
  if (!Number.isInteger(ms) || ms <= 0) throw new RangeError(`cadence must be a positive integer of ms, got ${ms}`);
  return ms === defaultMs ? base : `${base}:${ms}`;
}

/**
 * Double the desired cadence up to `maxMs`: 1000 → [1000, 2000, …, 32000, 60000].
 * @param {number} intervalMs @param {number} [maxMs=60000] @returns {number[]}
 */
export function deriveLadder(intervalMs, maxMs = 60000) {
  if (!(intervalMs > 0)) throw new RangeError(`intervalMs must be > 0, got ${intervalMs}`);
  const ladder = [intervalMs];
  while (ladder[ladder.length - 1] * 2 < maxMs) ladder.push(ladder[ladder.length - 1] * 2);
  if (ladder[ladder.length - 1] < maxMs) ladder.push(maxMs);
  return ladder;
}

/**
 * @typedef {object} AdaptiveOptions
 * @property {number} [maxMs=60000] top of the derived ladder
 * @property {number[]} [ladder] explicit cadences (rungs under intervalMs are ignored)
 * @property {number} [starvationFactor=1.8] gap over this × cadence: one step slower at once
 * @property {number} [healthyFactor=1.25] gap at most this × cadence: healthy
 * @property {number} [recoveryWindow=4] healthy gaps in a row before one step faster
 * @property {boolean} [enabled=true] false: fixed cadence, no measuring, no watchdog
 */

/** Decides, one frame at a time, whether to ask for a slower or faster cadence (AIMD). */
export class AdaptiveRate {
  /** @param {number} intervalMs desired cadence @param {AdaptiveOptions} [options] */
  constructor(intervalMs, options = {}) {
    const {
      maxMs = 60000, ladder, starvationFactor = 1.8, healthyFactor = 1.25, recoveryWindow = 4, enabled = true,
    } = options;
    if (!(healthyFactor >= 1 && healthyFactor < starvationFactor)) {
      throw new RangeError(`need 1 <= healthyFactor < starvationFactor, got ${healthyFactor} and ${starvationFactor}`);
    }
    if (!(recoveryWindow >= 1)) throw new RangeError(`recoveryWindow must be >= 1, got ${recoveryWindow}`);
    this.desiredMs = intervalMs;
    this.ladder = ladder
      ? [...new Set([intervalMs, ...ladder.filter((r) => r >= intervalMs)])].sort((a, b) => a - b)
      : deriveLadder(intervalMs, maxMs);
    this.starvationFactor = starvationFactor;
    this.healthyFactor = healthyFactor;
    this.recoveryWindow = recoveryWindow;
    this.enabled = enabled;
    this._index = 0;
    this._last = null;
    this._since = null;
    this._healthy = 0;
  }

  /** The cadence to subscribe to now, in ms. */
  get intervalMs() { return this.ladder[this._index]; }

  get healthyCount() { return this._healthy; }

  /** Restart the measurement: the next frame is only a reference. @param {number|null} [now] */
  reset(now = null) { this._last = null; this._since = now; this._healthy = 0; }

  _step(delta, now) {
    this._index += delta;
    this.reset(now);
    return delta > 0 ? "slower" : "faster";
  }

  /** Record a frame received at `now` (ms). @returns {"slower"|"faster"|null} */
  noteFrame(now) {
    if (!this.enabled) return null;
    const last = this._last;
    this._last = now;
    if (last === null) { this._since = now; return null; }
    const gap = now - last;
    const cadence = this.intervalMs;
    if (gap > this.starvationFactor * cadence) {
      this._healthy = 0;
      return this._index < this.ladder.length - 1 ? this._step(1, now) : null;
    }
    if (gap <= this.healthyFactor * cadence) {
      this._healthy += 1;
      if (this._healthy >= this.recoveryWindow) {
        this._healthy = 0;
        if (this._index > 0) return this._step(-1, now);
      }
      return null;
    }
    this._healthy = 0; // dead band
    return null;
  }

  /** Watchdog: with no frame for too long, step slower. @returns {"slower"|null} */
  checkStarvation(now) {
    if (!this.enabled) return null;
    const reference = this._last !== null ? this._last : this._since;
    if (reference === null) { this._since = now; return null; }
    if (now - reference > this.starvationFactor * this.intervalMs && this._index < this.ladder.length - 1) {
      return this._step(1, now);
    }
    return null;
  }
}

/** A JSON-RPC error answered by the server (`data.reason` says why). */
export class RpcError extends Error {
  constructor(error) {
    super(error.message);
    this.name = "RpcError";
    this.code = error.code;
    this.data = error.data || {};
    this.reason = this.data.reason;
  }
}

/** JSON-RPC codes of "not now" answers: admission refused the request before any work. */
export const REFUSAL_CODES = Object.freeze([-32003, -32004, -32005]);
/** Refusals of a renewed subscription that pass with time: sent again after retryAfterMs
 * (realtime_app.wire.retry.RENEWAL_RETRY_REASONS; tests/vectors/constants.json). */
export const RENEWAL_RETRY_REASONS = Object.freeze([
  "backplane_unavailable", "overloaded", "rate_limited", "too_many_in_flight", "too_many_resumes",
]);

/**
 * A request admission refused (overloaded, too_many_in_flight, rate_limited): nothing ran.
 * `retryAfterMs` says when it would pass; `snapshot` (when the method declares one) is the
 * state to resync to; `limit` the limit that applied.
 */
export class RefusedError extends RpcError {
  constructor(error) {
    super(error);
    this.name = "RefusedError";
    this.retryAfterMs = this.data.retry_after_ms;
    this.snapshot = this.data.snapshot;
    this.limit = this.data.limit;
  }
}

/**
 * The connection was lost after a call was sent and before its answer came: it may have
 * run or not. Only calls made `{idempotent: true}` are sent again (with their key, which
 * the server answers once); any other call rejects with this, and the application decides.
 */
export class OutcomeUnknownError extends Error {
  constructor(message) {
    super(message);
    this.name = "OutcomeUnknownError";
  }
}

/** A fresh idempotency key: 128 random bits, hex. */
function newKey() {
  const bytes = new Uint8Array(16);
  globalThis.crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** The error object of a JSON-RPC error response: a RefusedError for a refusal. */
export function errorFromResponse(error) {
  const data = (error && error.data) || {};
  const refused = REFUSAL_CODES.includes(error.code) && Number.isFinite(data.retry_after_ms);
  return refused ? new RefusedError(error) : new RpcError(error);
}

/**
 * How long to wait before retrying a refused request: `retryAfterMs`, plus up to a quarter
 * more at random (`u` in [0, 1)), so that refused clients do not come back all at once —
 * and never earlier than the server said.
 */
export function retryDelayMs(retryAfterMs, u = Math.random()) {
  return Math.ceil(retryAfterMs * (1 + 0.25 * u));
}

const OUR_EPOCH = /^[0-9a-f]{19}$/;

/**
 * True when `epoch` replaced `than`: later by the time it names when both are ours (19 hex
 * characters), else simply different. The twin of realtime_app.wire.history.newer_epoch.
 */
export function newerEpoch(epoch, than) {
  if (OUR_EPOCH.test(epoch) && OUR_EPOCH.test(than)) return epoch > than;
  return epoch !== than;
}

/**
 * A presence channel's members (a Map user -> {user, connections, info?}) after one
 * `presence` frame, as a new Map: a reset (or a channel too large to be listed) replaces
 * them, a diff removes `left` and sets `joined` and `updated`. The twin of
 * realtime_app.wire.presence.apply (both pass tests/vectors/presence.json).
 * @param {Map<string, object>} members @param {object} params @returns {Map<string, object>}
 */
export function applyPresence(members, params) {
  const listed = (list) => (list || []).filter((m) => m && typeof m === "object" && m.user != null);
  if (params.reset || params.listed === false) return new Map(listed(params.members).map((m) => [m.user, { ...m }]));
  const out = new Map(members);
  for (const user of params.left || []) out.delete(user);
  for (const member of [...listed(params.joined), ...listed(params.updated)]) out.set(member.user, { ...member });
  return out;
}

/** Messages held while a gap is recovered, at most; past it the client resyncs. */
export const MAX_HELD = 10000;

/** How long a resume (subscribe with `since`) may take: its replay comes first. */
export const RESUME_TIMEOUT_MS = 60000;

/**
 * Where the application is in one channel with history: each message once, in order, or
 * a resync. The twin of realtime_app/wire/cursor.py (both pass tests/vectors/cursor.json).
 * `message(params)` and `answer(result)` return actions: ["deliver", params],
 * ["recover", since] (subscribe again with `since`), ["recovered", replayed],
 * ["resync", {epoch, seq, reason}] (the gap cannot be filled: reload the state).
 */
export class EventCursor {
  constructor() {
    this.epoch = null;
    this.seq = 0;
    this.recovering = false;
    this._held = new Map(); // "epoch seq" -> {epoch, seq, params}
    this._start = 0;
  }

  /** The `since` of the next subscribe (null before the first position). */
  since() { return this.epoch === null ? null : { seq: this.seq, epoch: this.epoch }; }

  /** A subscribe with `since()` is being sent (a reconnect). */
  resuming() { this.recovering = true; this._start = this.seq; }

  /** The connection closed: what was held comes again with the resume. */
  closed() { this.recovering = false; this._held.clear(); }

  message(params) {
    const { epoch, seq } = params;
    if (!Number.isInteger(seq) || typeof epoch !== "string") return [["deliver", params]];
    if (this.epoch === null && !this.recovering) {
      this.epoch = epoch; this.seq = seq;
      return [["deliver", params]];
    }
    if (this.epoch !== null && epoch !== this.epoch && !newerEpoch(epoch, this.epoch)) return []; // a late frame of a replaced history
    if (epoch === this.epoch) {
      if (seq <= this.seq) return [];
      if (seq === this.seq + 1) {
        this.seq = seq;
        return [["deliver", params], ...this._drain()];
      }
    } else if (!this.recovering) {
      this._held.clear();
      const actions = [["resync", { epoch, seq: seq - 1, reason: "epoch_changed" }]];
      this.epoch = epoch; this.seq = seq;
      return [...actions, ["deliver", params], ...this._drain()];
    }
    this._held.set(`${epoch} ${seq}`, { epoch, seq, params });
    if (this._held.size > MAX_HELD) {
      this._held.clear();
      return this._giveUp(epoch, seq, "too_many_held");
    }
    return this.recovering ? [] : this._recover();
  }

  answer(result) {
    const epoch = result.epoch;
    const top = result.seq;
    const recovering = this.recovering;
    this.recovering = false;
    if (!("recovered" in result)) {
      if (this.epoch === null) { this.epoch = epoch; this.seq = top; }
      return this._drain();
    }
    if (!result.recovered) return this._giveUp(epoch, top, result.reason || "not_recovered");
    if (epoch === this.epoch && this.seq < top) {
      if (recovering && this.seq === this._start) return this._giveUp(epoch, top, "replay_lost");
      return this._recover();
    }
    return [["recovered", result.replayed || 0], ...this._drain()];
  }

  _giveUp(epoch, top, reason) {
    if (epoch !== this.epoch || top > this.seq || reason === "ahead") { this.epoch = epoch; this.seq = top; }
    const actions = [["resync", { epoch: this.epoch, seq: this.seq, reason }]];
    this.recovering = false;
    return [...actions, ...this._drain()];
  }

  _recover() {
    this.recovering = true;
    this._start = this.seq;
    return [["recover", this.since()]];
  }

  _drain() {
    const epoch = this.epoch ?? "";
    for (const [key, held] of this._held) {
      if (held.epoch === epoch ? held.seq <= this.seq : !newerEpoch(held.epoch, epoch)) this._held.delete(key);
    }
    const actions = [];
    for (let next; (next = this._held.get(`${epoch} ${this.seq + 1}`));) {
      this._held.delete(`${epoch} ${this.seq + 1}`);
      this.seq += 1;
      actions.push(["deliver", next.params]);
    }
    if (!this._held.size || this.recovering) return actions;
    const held = [...this._held.values()];
    if (held.some((h) => h.epoch === epoch)) return [...actions, ...this._recover()];
    const newer = held.map((h) => h.epoch).sort()[0]; // the history was lost meanwhile
    const first = Math.min(...held.filter((h) => h.epoch === newer).map((h) => h.seq));
    this.epoch = newer; this.seq = first - 1;
    actions.push(["resync", { epoch: newer, seq: first - 1, reason: "epoch_changed" }]);
    return [...actions, ...this._drain()];
  }
}

/**
 * A Server-Sent Events stream read as the WHATWG EventSource reads it (lines, data joined,
 * id, retry, comments), fed text as it arrives (realtime_app.wire.event_stream.EventParser;
 * tests/vectors/event_stream.json).
 */
export class EventParser {
  constructor() { this.buffer = ""; this.lastId = null; this.retryMs = null; this._event = ""; this._data = []; }

  /** @param {string} text @returns {{event: string, data: string, id: string|null}[]} */
  feed(text) {
    const out = [];
    this.buffer += text;
    for (;;) {
      const lf = this.buffer.indexOf("\n"), cr = this.buffer.indexOf("\r");
      if (lf === -1 && cr === -1) break;
      let end, next;
      if (cr === -1 || (lf !== -1 && lf < cr)) { end = lf; next = lf + 1; }
      else if (cr + 1 === this.buffer.length) break; // maybe the first half of a CRLF
      else { end = cr; next = this.buffer[cr + 1] === "\n" ? cr + 2 : cr + 1; }
      const line = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(next);
      const event = this._line(line);
      if (event) out.push(event);
    }
    return out;
  }

  _line(line) {
    if (line === "") {
      if (!this._data.length) { this._event = ""; return null; }
      const event = { event: this._event || "message", data: this._data.join("\n"), id: this.lastId };
      this._event = ""; this._data = [];
      return event;
    }
    if (line.startsWith(":")) return null;
    const colon = line.indexOf(":");
    const name = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "event") this._event = value;
    else if (name === "data") this._data.push(value);
    else if (name === "id" && !value.includes("\0")) this.lastId = value;
    else if (name === "retry" && /^\d+$/.test(value)) this.retryMs = Number(value);
    return null;
  }
}

/**
 * What an event of GET /realtime/sse is to the client, as a socket would have said it:
 * ["frame", text], ["answer", result], ["refused", error], ["close", code, reason] or
 * ["skip"] (realtime_app.wire.event_stream.translate).
 */
export function translateEvent(event) {
  if (!event.event.startsWith("realtime.")) return ["frame", `{"jsonrpc":"2.0","method":"message","params":${event.data}}`];
  let data;
  try { data = JSON.parse(event.data); } catch { return ["skip"]; }
  const kind = event.event.slice("realtime.".length);
  if (kind === "subscribed") return ["answer", data];
  if (kind === "error") return ["refused", data && typeof data === "object" && !Array.isArray(data) ? data.error : data];
  if (kind === "close") {
    const d = data && typeof data === "object" ? data : {};
    return ["close", Number(d.code ?? 1006), String(d.reason ?? "")];
  }
  if (kind === "resync") return ["skip"];
  return ["frame", JSON.stringify({ jsonrpc: "2.0", method: kind, params: data })];
}

function csrfToken() {
  const doc = globalThis.document;
  if (!doc) return null;
  const found = (doc.cookie || "").split(";").map((part) => part.trim()).find((part) => part.startsWith("csrftoken="));
  if (found) return decodeURIComponent(found.slice("csrftoken=".length));
  const field = doc.querySelector && doc.querySelector("[name=csrfmiddlewaretoken]"); // CSRF_COOKIE_HTTPONLY
  return field ? field.value : null;
}

/** Seconds without a byte on a stream before it is taken for dead (the server's heartbeat: 20 s). */
const READ_TIMEOUT_MS = 60000;

/** The close a socket would have had for a refused stream or probe, and its reason
 * (with `retry_after_ms=<n>` when the server says when): realtime_app.client.event_stream.refusal_of. */
async function refusalOf(response) {
  let error = {};
  try { error = (await response.json()).error || {}; } catch { /* not ours */ }
  const data = (error && error.data) || {};
  let code = data.close_code;
  if (!Number.isInteger(code)) code = { 401: 4002, 403: 1008, 429: 1013 }[response.status] ?? (response.status >= 500 ? 1013 : 1006);
  let reason = error.message || `HTTP ${response.status}`;
  if (Number.isInteger(data.retry_after_ms)) reason += ` retry_after_ms=${data.retry_after_ms}`;
  return { code, reason, error, data };
}

/**
 * The endpoint over HTTP, with a WebSocket's face: GET /realtime/sse (read with fetch, so
 * that it carries Last-Event-ID and a Bearer token) for what the server pushes, POST
 * /realtime/rpc for calls (with the session's CSRF token). A subscribe or unsubscribe opens
 * a stream with the new set of channels before the old one closes (one open at a time: an
 * older set never replaces a newer one); its "realtime.subscribed" events answer the
 * subscribes in order (docs/sse.md). (realtime_app.client.event_stream.EventStreamSocket.)
 */
export class SseSocket {
  /** @param {string} url ws(s)://host/realtime/ or http(s)://… @param {{fetch?: Function, token?: string}} [options] */
  constructor(url, options = {}) {
    this.base = (url.startsWith("ws") ? "http" + url.slice(2) : url).replace(/\/?$/, "/");
    this.fetch = options.fetch || globalThis.fetch.bind(globalThis);
    this.token = options.token;
    this.readyState = 0;
    this.onopen = null; this.onmessage = null; this.onclose = null;
    this.onstream = null; // a stream opened (the client's backoff restarts)
    this.refusedStream = false; // it ended on a refused stream
    this._channels = new Map(); // requested name -> ids of its subscribes awaiting an answer
    this._since = new Map(); // requested name -> the since its subscribe asked
    this._canonical = new Map(); // requested name -> the server's name of it
    this._served = new Map(); // requested name -> the answer of the stream carrying it
    this._positions = {}; // the stream's last id: canonical name -> [seq, epoch]
    this._stream = null; // the AbortController of the stream being read
    this._opening = null; // the promise of the loop that (re)opens streams
    this._dirty = false;
    this._open();
  }

  _headers(extra = {}) {
    const headers = { ...extra };
    if (this.token) headers.Authorization = `Bearer ${this.token}`;
    return headers;
  }

  async _open() {
    try {
      const token = csrfToken();
      const response = await this.fetch(`${this.base}rpc`, {
        method: "POST", credentials: "same-origin", body: JSON.stringify({ jsonrpc: "2.0", method: "ping" }),
        headers: this._headers({ "Content-Type": "application/json", ...(token ? { "X-CSRFToken": token } : {}) }),
      });
      if (response.status !== 200 && response.status !== 204) {
        const { code, reason } = await refusalOf(response);
        return this._end(code, reason);
      }
      if (this.readyState !== 0) return;
      this.readyState = 1;
      if (this.onopen) this.onopen({});
    } catch (err) {
      this._end(1006, String(err));
    }
  }

  send(text) {
    if (this.readyState !== 1) throw new Error("not open");
    const message = JSON.parse(text);
    const batch = Array.isArray(message);
    const remote = [];
    for (const request of batch ? message : [message]) {
      const params = request && request.params;
      const channel = params && typeof params === "object" ? params.channel : undefined;
      if (request.method === "subscribe" && typeof channel === "string") {
        if (this._served.has(channel) && this._channels.has(channel) && !params.since) {
          // the stream carries it already: answered as it was, no new stream (each costs every channel)
          this._put({ jsonrpc: "2.0", result: this._served.get(channel), id: request.id });
          continue;
        }
        if (!this._channels.has(channel)) this._channels.set(channel, []);
        this._channels.get(channel).push(request.id);
        if (params.since && typeof params.since === "object") this._since.set(channel, params.since);
        this._changed();
      } else if (request.method === "unsubscribe" && typeof channel === "string") {
        const waiting = this._channels.get(channel);
        this._served.delete(channel);
        for (const id of waiting || []) { // a subscribe not answered yet: it never will be
          this._put({ jsonrpc: "2.0", error: { code: -32603, message: "Unsubscribed before its answer", data: { reason: "unsubscribed" } }, id });
        }
        this._channels.delete(channel);
        this._since.delete(channel);
        delete this._positions[this._canonical.get(channel) || channel]; // a later subscribe starts afresh
        this._canonical.delete(channel);
        if (request.id !== undefined) this._put({ jsonrpc: "2.0", result: { channel, unsubscribed: waiting !== undefined }, id: request.id });
        this._changed();
      } else remote.push(request);
    }
    if (remote.length) this._post(remote, batch);
  }

  close(code = 1000, reason = "") { this._end(code, reason); }

  _put(message) { if (this.readyState === 1 && this.onmessage) this.onmessage({ data: typeof message === "string" ? message : JSON.stringify(message) }); }

  _end(code, reason) {
    if (this.readyState === 3) return;
    this.readyState = 3;
    if (this._stream) this._stream.abort();
    this._stream = null;
    if (this.onclose) this.onclose({ code, reason });
  }

  _changed() {
    this._dirty = true;
    if (this._opening || this.readyState === 3) return;
    this._opening = (async () => {
      try {
        while (this._dirty && this.readyState === 1) {
          await new Promise((resolve) => setTimeout(resolve, 10)); // subscribes made together join one stream
          this._dirty = false;
          await this._openOnce();
        }
      } finally {
        this._opening = null;
      }
    })();
  }

  async _openOnce() {
    const names = [...this._channels.keys()];
    if (!names.length) { if (this._stream) this._stream.abort(); this._stream = null; return; }
    const wanted = new Set([...names, ...names.map((name) => this._canonical.get(name) || name)]);
    const positions = Object.fromEntries(Object.entries(this._positions).filter(([channel]) => wanted.has(channel)));
    const since = new Map([...this._since].filter(([name]) => wanted.has(name)));
    for (const [name, value] of since) if (value.epoch && Number.isInteger(value.seq)) positions[this._canonical.get(name) || name] = [value.seq, value.epoch];
    const headers = this._headers({ Accept: "text/event-stream" });
    if (Object.keys(positions).length) headers["Last-Event-ID"] = JSON.stringify(positions);
    const query = names.map((name) => `channel=${encodeURIComponent(name)}`).join("&");
    const controller = new AbortController();
    let response;
    try {
      response = await this.fetch(`${this.base}sse?${query}`, { headers, credentials: "same-origin", signal: controller.signal, cache: "no-store" });
    } catch (err) {
      return this._end(1006, String(err));
    }
    if (this.readyState !== 1) { controller.abort(); return; } // closed while it opened: nobody's stream
    if (response.status !== 200) return this._refused(response);
    for (const [name, value] of since) if (this._since.get(name) === value) this._since.delete(name);
    const old = this._stream;
    this._stream = controller;
    if (old) old.abort(); // the new stream is open: the old one goes
    this._read(response, names, controller);
  }

  async _refused(response) {
    const { code, reason, error, data } = await refusalOf(response);
    let asked = data.requested ?? data.channel;
    if (!this._channels.has(asked)) { // not named (too many channels): the newest waiting subscribe
      asked = [...this._channels].filter(([, ids]) => ids.length).map(([name]) => name).pop();
    }
    if ([400, 403, 404].includes(response.status) && this._channels.has(asked)) {
      for (const id of this._channels.get(asked)) this._put({ jsonrpc: "2.0", error, id });
      this._channels.delete(asked);
      this._since.delete(asked);
      this._dirty = true; // the others, without the refused one (the opening loop goes on)
      return;
    }
    if (response.status === 429 && this._stream) {
      // the client's pace, with a stream open: the new subscribes are refused (as a socket's
      // would be: RefusedError, retryAfterMs), the open stream goes on
      for (const [name, ids] of [...this._channels]) {
        if (!ids.length) continue;
        for (const id of ids) this._put({ jsonrpc: "2.0", error, id });
        this._channels.delete(name);
        this._since.delete(name);
      }
      return;
    }
    this.refusedStream = true;
    this._end(code, reason);
  }

  async _read(response, names, controller) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const parser = new EventParser();
    let answered = 0;
    let watchdog = null;
    const arm = () => { clearTimeout(watchdog); watchdog = setTimeout(() => controller.abort(), READ_TIMEOUT_MS); };
    try {
      for (;;) {
        arm(); // a stream quiet past its heartbeats is a dead one (a half-open connection)
        const { value, done } = await reader.read();
        if (done) break;
        for (const event of parser.feed(decoder.decode(value, { stream: true }))) {
          if (this._stream !== controller) return;
          if (event.id && event.id !== "-") { try { this._positions = JSON.parse(event.id); } catch { /* not ours */ } }
          const action = translateEvent(event);
          if (action[0] === "frame") this._put(action[1]);
          else if ((action[0] === "answer" || action[0] === "refused") && answered < names.length) {
            const name = names[answered++];
            if (answered === names.length && !this._dirty && this.onstream) this.onstream(); // the whole set answered
            if (action[0] === "answer" && action[1] && typeof action[1].channel === "string") {
              this._canonical.set(name, action[1].channel);
              this._served.set(name, action[1]);
            }
            const key = action[0] === "answer" ? "result" : "error";
            for (const id of this._channels.get(name) || []) this._put({ jsonrpc: "2.0", [key]: action[1], id });
            if (this._channels.has(name)) {
              if (action[0] === "refused") this._channels.delete(name); else this._channels.set(name, []);
            }
          } else if (action[0] === "close") return this._end(action[1], action[2]);
        }
      }
      if (this._stream === controller) this._end(1006, "stream ended");
    } catch (err) {
      if (this._stream === controller) this._end(1006, String(err));
    } finally {
      clearTimeout(watchdog);
    }
  }

  async _post(requests, batch) {
    const token = csrfToken();
    let response, text;
    try {
      response = await this.fetch(`${this.base}rpc`, {
        method: "POST", credentials: "same-origin", body: JSON.stringify(batch ? requests : requests[0]),
        headers: this._headers({ "Content-Type": "application/json", ...(token ? { "X-CSRFToken": token } : {}) }),
      });
      text = await response.text();
    } catch (err) {
      return this._end(1006, String(err));
    }
    if (response.status === 200) return this._put(text);
    if (response.status === 204) return;
    let error;
    try { error = JSON.parse(text).error; } catch { /* below */ }
    error = error || { code: -32603, message: `HTTP ${response.status}`, data: { reason: "http_error" } };
    for (const request of requests) if (request && request.id !== undefined) this._put({ jsonrpc: "2.0", error, id: request.id });
  }
}

function defaultUrl() {
  const scheme = globalThis.location && globalThis.location.protocol === "https:" ? "wss" : "ws";
  return `${scheme}://${globalThis.location.host}/realtime/`;
}

/**
 * WebSocket client of the realtime_app endpoint. Events: "state" (detail: "connecting" |
 * "open" | "reconnecting" | "closed"), "close" (detail: {code, reason, willReconnect}),
 * "subscribed" (detail: subscribe result), "subscribeerror" (detail: {channel, error}:
 * a subscribe the server refused, also when it is renewed after a reconnect). Channels
 * with history (docs/recovery.md) are delivered once and in order across drops and
 * reconnects: "recovered" (detail: {channel, replayed}) when a resume filled a gap,
 * "resync" (detail: {channel, epoch, seq, reason}) when messages were missed for good and
 * the application should reload its state. Presence channels subscribed `{presence: true}`
 * (docs/presence.md): "presence" (detail: {channel, diff, members}) at each change, at
 * most once per the server's interval; `members(channel)` is the member set kept.
 */
export class RealtimeClient extends EventTarget {
  /**
   * @param {object} [options]
   * @param {string} [options.url] default: ws(s)://<this host>/realtime/
   * @param {number} [options.callTimeoutMs=10000]
   * @param {number} [options.backoffInitialMs=500] @param {number} [options.backoffMaxMs=30000]
   * @param {typeof WebSocket} [options.WebSocket]
   * @param {string} [options.token] a connection token (docs/auth.md): a page on another
   *   domain signs in with it (RPC `auth`, the first call of every connection)
   * @param {() => Promise<string>|string} [options.refreshToken] a new token when the server
   *   says this one expires (`token_expiring`); without it the connection ends at expiry (4004)
   * @param {string[]} [options.transports=["websocket"]] in order of preference:
   *   `["websocket", "sse"]` falls back to Server-Sent Events and HTTP RPC when a WebSocket
   *   cannot open, and tries the WebSocket again every `retryWebSocketMs` (docs/sse.md)
   * @param {number} [options.retryWebSocketMs=60000] @param {typeof fetch} [options.fetch]
   */
  constructor(options = {}) {
    super();
    this.url = options.url || defaultUrl();
    this.transports = options.transports || ["websocket"];
    for (const kind of this.transports) {
      if (kind !== "websocket" && kind !== "sse") throw new RangeError(`unknown transport ${kind}`);
    }
    this.transport = this.transports[0]; // the one in use (or tried next)
    this.retryWebSocketMs = options.retryWebSocketMs ?? 60000;
    this.fetch = options.fetch;
    this._upgrade = null; // the timer of the next WebSocket try while on SSE
    this.callTimeoutMs = options.callTimeoutMs ?? 10000;
    this.backoffInitialMs = options.backoffInitialMs ?? 500;
    this.backoffMaxMs = options.backoffMaxMs ?? 30000;
    this.WebSocket = options.WebSocket || globalThis.WebSocket;
    this.token = options.token;
    this.refreshToken = options.refreshToken;
    this.state = "closed";
    this.attempt = 0;
    this._ws = null;
    this._nextId = 1;
    this._pending = new Map(); // id -> {resolve, reject, timer}
    this._handlers = new Map(); // requested name -> Set(handler)
    this._canonical = new Map(); // requested name -> canonical name
    this._waiters = new Map(); // requested name -> [{resolve, reject}] until the server answers
    this._answers = new Map(); // requested name -> the server's last answer
    this._onError = new Map(); // requested name -> Set(onError)
    this._cursors = new Map(); // canonical name -> EventCursor (channels with history)
    this._stopped = true;
    this._timer = null;
    this._blipMs = undefined; // set by reconnect(): the delay before the new connection
    this._ticket = undefined; // a drain's reconnect ticket, shown (by a WebSocket) until one is served
    this._deltaWanted = new Set(); // requested names subscribed with deltas
    this._bases = new Map(); // canonical name -> the last data's JSON bytes (null until a full frame)
    this._resyncing = new Set(); // canonical names subscribed again for a full frame
    this._presenceWanted = new Set(); // requested names subscribed with presence
    this._members = new Map(); // canonical name -> Map(user -> member)
  }

  _setState(state) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: state }));
  }

  /** Open the connection (and keep it open until `close()`). */
  connect() {
    this._stopped = false;
    if (this._ws) return;
    this._setState(this.attempt ? "reconnecting" : "connecting");
    const kind = this.transport;
    const ws = kind === "sse"
      ? new SseSocket(this.url, { fetch: this.fetch, token: this.token })
      : new this.WebSocket(withTicket(this.url, this._ticket));
    this._ws = ws;
    let opened = false;
    if (kind === "sse") ws.onstream = () => { this.attempt = 0; }; // its backoff restarts when a stream opens
    ws.onopen = () => {
      opened = true;
      if (kind !== "sse" || !this._streamRefused) this.attempt = 0;
      if (this.token && kind === "websocket") { // the first request: what follows is the token's user's
        this._callOnce("auth", { token: this.token }, {}).catch((err) => console.error("auth refused", err));
      }
      if (kind !== this.transports[0]) this._scheduleUpgrade();
      this._setState("open");
      for (const name of this._handlers.keys()) this._resubscribe(name, ws);
    };
    ws.onmessage = (event) => {
      this._ticket = undefined; // served (a refusal closes before any frame): spent
      this._onMessage(event.data);
    };
    ws.onclose = (event) => {
      const next = this.transports[this.transports.indexOf(kind) + 1];
      this._streamRefused = Boolean(ws.refusedStream);
      if (!opened && next && event.code === 1006 && !this._stopped && this._blipMs === undefined) {
        this.transport = next; // this network does not let it open: the next transport, now
        this._blipMs = 0;
      } else if (!opened && kind !== this.transports[0]) {
        this.transport = this.transports[0]; // the fallback did not open either (the server is away): the first again
      }
      this._onClose(event.code, event.reason);
    };
  }

  /** While on a fallback, try the first transport again every `retryWebSocketMs`: once a
   * WebSocket opens, the connection moves back to it (a blip: resubscribed, resumed). */
  _scheduleUpgrade() {
    clearTimeout(this._upgrade);
    this._upgrade = setTimeout(() => {
      if (this._stopped || this.transport === this.transports[0]) return;
      const probe = new this.WebSocket(this.url);
      let opened = false;
      probe.onopen = () => {
        opened = true;
        probe.close(1000);
        if (this._stopped) return;
        this.transport = this.transports[0];
        this.reconnect(0);
      };
      probe.onclose = () => { if (!opened) this._scheduleUpgrade(); };
    }, this.retryWebSocketMs);
  }

  /**
   * Drop the connection now and open a new one after `delayMs`, as after a network blip
   * (demos and tests): subscriptions are renewed, channels with history resume.
   */
  reconnect(delayMs = 0) {
    if (!this._ws) return;
    this._blipMs = delayMs;
    this._ws.close(3000, "reconnect");
  }

  /** Close for good (no reconnect). */
  close(code = 1000) {
    this._stopped = true;
    clearTimeout(this._timer);
    clearTimeout(this._upgrade);
    if (this._ws) this._ws.close(code);
  }

  _onClose(code, reason) {
    this._ws = null;
    for (const cursor of this._cursors.values()) cursor.closed();
    for (const channel of this._bases.keys()) this._bases.set(channel, null); // full frames again
    this._resyncing.clear();
    this._members.clear(); // known again from the reset that follows the next subscribe
    for (const [id, call] of this._pending) {
      clearTimeout(call.timer);
      call.reject(new OutcomeUnknownError(`connection lost, outcome unknown (closed ${code})`));
      this._pending.delete(id);
    }
    const blip = this._blipMs;
    this._blipMs = undefined;
    const renew = code === 4004 && Boolean(this.refreshToken) && !this._stopped; // the token expired: a new one
    const willReconnect = !this._stopped && (isReconnectableCloseCode(code) || blip !== undefined || renew);
    this.dispatchEvent(new CustomEvent("close", { detail: { code, reason, willReconnect } }));
    if (!willReconnect) { this._stopped = true; this._setState("closed"); return; }
    if (renew) { this._renew(); return; }
    const cap = Math.min(this.backoffMaxMs, this.backoffInitialMs * 2 ** this.attempt);
    const told = /\bretry_after_ms=(\d{1,9})\b/.exec(reason || ""); // a draining server says when
    this._ticket = reconnectTicket(reason) ?? this._ticket; // and hands it over: shown on the next handshake
    const backoff = cap / 2 + Math.random() * (cap / 2);
    // a refused stream's bucket said when; the next stream may carry more: the backoff too
    const toldMs = told ? (this.transport === "sse" ? Math.max(Number(told[1]), backoff) : Number(told[1])) : undefined;
    const delay = blip ?? toldMs ?? backoff; // else jittered, capped
    this.attempt += 1;
    this._setState("reconnecting");
    this._timer = setTimeout(() => this.connect(), delay);
  }

  _onMessage(text) {
    let message;
    try { message = JSON.parse(text); } catch { return; }
    for (const item of Array.isArray(message) ? message : [message]) {
      if (item && item.method === "message" && item.params) {
        this._deliver(item.params);
      } else if (item && item.method === "presence" && item.params) {
        this._presence(item.params);
      } else if (item && item.method === "token_expiring") {
        this._refresh();
      } else if (item && item.id !== undefined && this._pending.has(item.id)) {
        const call = this._pending.get(item.id);
        this._pending.delete(item.id);
        clearTimeout(call.timer);
        if (item.error) call.reject(errorFromResponse(item.error)); else call.resolve(item.result);
      }
    }
  }

  async _renew() {
    this._setState("reconnecting");
    try {
      this.token = await this.refreshToken();
    } catch (err) {
      console.error("the connection token expired and a new one could not be had", err);
      this._stopped = true;
      this._setState("closed");
      return;
    }
    if (!this._stopped) this.connect();
  }

  async _refresh() {
    if (!this.refreshToken) { console.warn("the connection token expires soon and no refreshToken was given"); return; }
    try {
      this.token = await this.refreshToken();
      if (this._ws instanceof SseSocket) { this._ws.token = this.token; this._ws._changed(); } // its next stream's header
      else await this.call("auth", { token: this.token });
    } catch (err) {
      console.error("refreshing the connection token failed", err);
    }
  }

  _presence(params) {
    const channel = params.channel;
    const wanted = this._members.has(channel) // or a presence subscribe whose answer is still to come
      || [...this._presenceWanted].some((name) => !this._canonical.has(name) || this._canonical.get(name) === channel);
    if (!wanted) return; // in flight after an unsubscribe
    const members = applyPresence(this._members.get(channel) || new Map(), params);
    this._members.set(channel, members);
    this.dispatchEvent(new CustomEvent("presence", { detail: { channel, diff: params, members: new Map(members) } }));
  }

  /**
   * Who is in `channel` (subscribed `{presence: true}`): a Map user -> {user, connections,
   * info?} as of the last "presence" event (empty while the channel has more members than
   * are listed: call "presence" for pages).
   * @param {string} channel @returns {Map<string, object>}
   */
  members(channel) {
    return new Map(this._members.get(this._canonical.get(channel) || channel) || []);
  }

  _deliver(params) {
    if ("delta" in params) { // only delta subscriptions carry it (maybe before the subscribe's answer)
      if (!this._bases.has(params.channel)) {
        const ours = this._deltaWanted.has(params.channel) || [...this._canonical.values()].includes(params.channel);
        if (!ours) return; // still in flight after an unsubscribe
        this._bases.set(params.channel, null);
      }
      params = this._rebuild(params);
      if (!params) return;
    }
    if (typeof params.epoch === "string") { // a channel with history: in order, once
      const cursor = this._cursors.get(params.channel); // none: a frame in flight after unsubscribe
      if (cursor) this._act(params.channel, cursor.message(params));
      return;
    }
    this._handOver(params);
  }

  /**
   * A frame of a delta subscription made whole: `data` parsed from the full text, or from
   * the delta applied to the last one. A delta without its base, or for another one (the
   * checksum says so), is never applied: the channel is subscribed again, which brings a
   * full frame.
   */
  _rebuild(params) {
    const channel = params.channel;
    try {
      if (typeof params.data !== "string") throw new Error("data is not a string");
      let bytes;
      if (params.delta) {
        const base = this._bases.get(channel);
        if (!base) throw new Error("a delta without its base");
        bytes = new Uint8Array(applyDelta(base, Uint8Array.from(params.data, (c) => c.charCodeAt(0))));
      } else {
        bytes = UTF8.encode(params.data);
      }
      const data = JSON.parse(UTF8_STRICT.decode(bytes));
      this._bases.set(channel, bytes);
      if (!params.delta) this._resyncing.delete(channel);
      return { ...params, data };
    } catch (error) {
      this._bases.set(channel, null);
      if (this._resyncing.has(channel)) return null; // subscribed again already: waiting for a full frame
      this._resyncing.add(channel);
      console.warn(`${channel}: a delta frame that does not apply (${error.message}): subscribing again`);
      const names = [...this._canonical].filter(([, canonical]) => canonical === channel).map(([name]) => name);
      for (const name of names.length ? names : [channel]) this._subscribeRemote(name).catch(() => {}); // reported there
      return null;
    }
  }

  _act(channel, actions) {
    for (const [kind, value] of actions) {
      if (kind === "deliver") this._handOver(value);
      else if (kind === "recover") this._recover(channel);
      else if (kind === "recovered") this.dispatchEvent(new CustomEvent("recovered", { detail: { channel, replayed: value } }));
      else {
        console.warn(`${channel}: messages missed for good (${value.reason}): resync`);
        this.dispatchEvent(new CustomEvent("resync", { detail: { channel, ...value } }));
      }
    }
  }

  _applyAnswer(channel, result, cursor) {
    if (this._cursors.get(channel) !== cursor) return; // left (and maybe subscribed again) meanwhile
    if (result && result.epoch !== undefined) {
      this._act(channel, cursor.answer(result));
    } else if (cursor) { // the channel keeps no history (any more)
      this._cursors.delete(channel);
      if (result && result.recovered === false) {
        this._act(channel, [["resync", { epoch: cursor.epoch, seq: cursor.seq, reason: result.reason || "no_history" }]]);
      }
    }
  }

  /**
   * Subscribe again `since` the last message: the server replays the gap. Ends with its
   * connection, or when the channel is left (a reconnect resumes anew).
   */
  async _recover(channel) {
    const ws = this._ws;
    const cursor = this._cursors.get(channel);
    for (;;) {
      if (!cursor || !cursor.recovering || this._ws !== ws || !ws || ws.readyState !== 1) return;
      if (this._cursors.get(channel) !== cursor) return;
      try {
        const params = { channel, since: cursor.since() };
        if (this._bases.has(channel)) params.delta = "fossil"; // the replay comes whole; deltas go on after it
        const result = await this._callOnce("subscribe", params, { timeoutMs: Math.max(this.callTimeoutMs, RESUME_TIMEOUT_MS) });
        this._applyAnswer(channel, result, cursor);
        return;
      } catch (err) {
        const delay = err instanceof RefusedError ? retryDelayMs(err.retryAfterMs) : 1000;
        await new Promise((resolve) => setTimeout(resolve, delay));
      }
    }
  }

  _handOver(params) {
    for (const [name, handlers] of this._handlers) {
      if (this._canonical.get(name) === params.channel || name === params.channel) {
        for (const handler of handlers) {
          try { handler(params); } catch (err) { console.error(err); }
        }
      }
    }
  }

  /**
   * Call a method; resolves with its result, rejects with RpcError (RefusedError when
   * admission refused it), a timeout Error, or OutcomeUnknownError (the connection was lost
   * before the answer: never retried silently). `retries`: how many times a refused call is
   * sent again after its `retryAfterMs` (jittered); 0 by default — retrying is the
   * application's choice (a stale "fire" may be worse than none). `idempotent` (methods
   * registered so): the call carries an `idempotency_key` and is sent again with it after a
   * reconnect, within `timeoutMs`; the server runs it once and answers each try alike.
   * @param {string} method @param {object|Array} [params]
   * @param {{timeoutMs?: number, retries?: number, idempotent?: boolean}} [options]
   */
  async call(method, params, options = {}) {
    let retries = options.retries ?? 0;
    const deadline = Date.now() + (options.timeoutMs ?? this.callTimeoutMs); // resends of an idempotent call, until then
    if (options.idempotent) {
      if (params !== undefined && (typeof params !== "object" || Array.isArray(params))) {
        throw new TypeError("an idempotent call takes by-name params (an object): its key is one of them");
      }
      params = { idempotency_key: newKey(), ...(params || {}) };
    }
    for (;;) {
      try {
        if (options.idempotent && !(this._ws && this._ws.readyState === 1)) await this._opened(Math.max(1, deadline - Date.now()));
        return await this._callOnce(method, params, options); // every try its full timeout
      } catch (err) {
        if (err instanceof OutcomeUnknownError && options.idempotent && !this._stopped && Date.now() < deadline) continue;
        if (!(err instanceof RefusedError) || retries <= 0) throw err;
        retries -= 1;
        await new Promise((resolve) => setTimeout(resolve, retryDelayMs(err.retryAfterMs)));
      }
    }
  }

  /** Resolves when the connection is open, rejects after `timeoutMs`. */
  _opened(timeoutMs) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => { this.removeEventListener("state", onState); reject(new Error("not connected")); }, timeoutMs);
      const onState = (event) => {
        if (event.detail !== "open") return;
        clearTimeout(timer);
        this.removeEventListener("state", onState);
        resolve();
      };
      this.addEventListener("state", onState);
    });
  }

  _callOnce(method, params, options) {
    const ws = this._ws;
    if (!ws || ws.readyState !== 1) return Promise.reject(new Error("not connected"));
    const id = this._nextId++;
    const timeoutMs = options.timeoutMs ?? this.callTimeoutMs;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this._pending.delete(id);
        reject(new Error(`${method} timed out after ${timeoutMs} ms`));
      }, timeoutMs);
      this._pending.set(id, { resolve, reject, timer });
      const request = { jsonrpc: "2.0", method, id };
      if (params !== undefined) request.params = params;
      ws.send(JSON.stringify(request));
    });
  }

  /** Send a notification (no answer). */
  notify(method, params) {
    if (!this._ws || this._ws.readyState !== 1) return;
    const request = { jsonrpc: "2.0", method };
    if (params !== undefined) request.params = params;
    this._ws.send(JSON.stringify(request));
  }

  /**
   * Renew a subscription on a new connection; refused for now (`retryAfterMs`: too many
   * resumes at once after a deploy, say), sent again after that delay while this
   * connection and the subscription last. Other refusals are reported by _subscribeRemote.
   */
  _resubscribe(name, ws) {
    this._subscribeRemote(name).catch((err) => {
      if (!(err instanceof RefusedError) || !RENEWAL_RETRY_REASONS.includes(err.reason)) return; // reported there
      setTimeout(() => {
        if (this._ws === ws && ws.readyState === 1 && this._handlers.has(name)) this._resubscribe(name, ws);
      }, retryDelayMs(err.retryAfterMs));
    });
  }

  async _subscribeRemote(name) {
    const canonical = this._canonical.get(name) || name;
    if (!this._cursors.has(canonical)) this._cursors.set(canonical, new EventCursor()); // dropped unless kept
    const cursor = this._cursors.get(canonical);
    const params = { channel: name };
    if (this._deltaWanted.has(name) || this._bases.has(canonical)) params.delta = "fossil";
    if (this._presenceWanted.has(name)) params.presence = true; // a reset with every member first, then diffs
    const since = cursor.since();
    if (since) params.since = since; // a resume: the server replays what was missed
    cursor.resuming(); // what arrives before the answer waits for the position it gives
    let result;
    try {
      result = await this.call("subscribe", params, since ? { timeoutMs: Math.max(this.callTimeoutMs, RESUME_TIMEOUT_MS) } : {});
      this._applyAnswer(canonical, result, cursor);
    } catch (error) {
      if (cursor) cursor.closed(); // no resume running: the next subscribe tries again
      if (!this._handlers.has(name)) throw error; // unsubscribed meanwhile
      for (const waiter of this._waiters.get(name) || []) waiter.reject(error);
      this._waiters.delete(name);
      for (const onError of this._onError.get(name) || []) {
        try { onError(error); } catch (err) { console.error(err); }
      }
      this.dispatchEvent(new CustomEvent("subscribeerror", { detail: { channel: name, error } }));
      throw error;
    }
    this._canonical.set(name, result.channel);
    if (result.delta === "fossil" && !this._bases.has(result.channel)) this._bases.set(result.channel, null); // a full frame first
    this._answers.set(name, result);
    for (const waiter of this._waiters.get(name) || []) waiter.resolve(result);
    this._waiters.delete(name);
    this.dispatchEvent(new CustomEvent("subscribed", { detail: result }));
    return result;
  }

  /**
   * Subscribe `handler(params)` to `channel`; kept across reconnects until unsubscribed.
   * Resolves with the server's answer ({channel, kind, interval_ms}) — when the connection
   * opens, if it is not open yet — and rejects with an RpcError when the server refuses
   * (forbidden, unknown channel...). A refusal of a later re-subscription (after a
   * reconnect) calls `options.onError(error)` and dispatches "subscribeerror".
   * @param {string} channel @param {(params: object) => void} handler
   * `options.delta: "fossil"` asks for deltas (docs/protocol.md): the handler gets whole
   * `data` all the same, rebuilt from the last one.
   * `options.presence: true` on a presence channel: who is in it, kept (`members()`) and
   * told ("presence" events).
   * @param {{onError?: (error: Error) => void, delta?: "fossil", presence?: boolean}} [options]
   */
  subscribe(channel, handler, options = {}) {
    const again = Boolean(options.presence) && !this._presenceWanted.has(channel); // asked for presence now
    if (options.presence) this._presenceWanted.add(channel);
    if (options.delta !== undefined) {
      if (options.delta !== "fossil") throw new RangeError(`delta must be "fossil", got ${options.delta}`);
      this._deltaWanted.add(channel);
    }
    let handlers = this._handlers.get(channel);
    const first = !handlers;
    if (first) { handlers = new Set(); this._handlers.set(channel, handlers); }
    handlers.add(handler);
    if (options.onError) {
      if (!this._onError.has(channel)) this._onError.set(channel, new Set());
      this._onError.get(channel).add(options.onError);
    }
    if (again && !first && this._ws && this._ws.readyState === 1) return this._subscribeRemote(channel);
    if (!first && this._answers.has(channel)) return Promise.resolve(this._answers.get(channel));
    const answer = new Promise((resolve, reject) => {
      if (!this._waiters.has(channel)) this._waiters.set(channel, []);
      this._waiters.get(channel).push({ resolve, reject });
    });
    if (first && this._ws && this._ws.readyState === 1) this._subscribeRemote(channel).catch(() => {}); // settles `answer`
    return answer;
  }

  /** Remove `handler` (or all handlers) from `channel`; the last one out unsubscribes. */
  async unsubscribe(channel, handler) {
    const handlers = this._handlers.get(channel);
    if (!handlers) return;
    if (handler) handlers.delete(handler); else handlers.clear();
    if (handlers.size) return;
    this._handlers.delete(channel);
    this._onError.delete(channel);
    this._answers.delete(channel);
    for (const waiter of this._waiters.get(channel) || []) waiter.reject(new Error(`unsubscribed from ${channel}`));
    this._waiters.delete(channel);
    const canonical = this._canonical.get(channel) || channel;
    this._canonical.delete(channel);
    this._deltaWanted.delete(channel);
    this._presenceWanted.delete(channel);
    const stillUsed = [...this._canonical.values()].includes(canonical);
    if (!stillUsed) {
      this._cursors.delete(canonical); this._bases.delete(canonical); this._resyncing.delete(canonical); this._members.delete(canonical);
    }
    if (!stillUsed && this._ws && this._ws.readyState === 1) { // the channel the server subscribed (a nearer cadence, say)
      await this.call("unsubscribe", { channel: canonical }).catch(() => {});
    }
  }
}

/**
 * Follow a cadenced state family adaptively: subscribe to `base` at the cadence the
 * client can absorb, switching make-before-break (new cadence first, then leave the old)
 * so `handler` sees one uninterrupted stream. Never use it on event channels: a slower
 * cadence there would lose messages.
 * @param {RealtimeClient} client @param {string} base @param {number} intervalMs desired cadence
 * @param {(params: object) => void} handler
 * @param {AdaptiveOptions & {defaultMs?: number, now?: () => number, onError?: (error: Error) => void}} [options]
 *   `onError`: a refused subscribe (default: logged to the console)
 */
export function bindAdaptiveChannel(client, base, intervalMs, handler, options = {}) {
  const now = options.now || (() => performance.now());
  const rate = new AdaptiveRate(intervalMs, options);
  const target = new EventTarget();
  let channel = rateChannel(base, rate.intervalMs, options.defaultMs);
  let watchdog = null;
  let closed = false;
  let switching = Promise.resolve();

  const onFrame = (name) => (params) => {
    handler(params);
    if (name === channel) decide(rate.noteFrame(now()));
  };
  const handlers = new Map();
  const handlerFor = (name) => {
    if (!handlers.has(name)) handlers.set(name, onFrame(name));
    return handlers.get(name);
  };

  function arm() {
    clearTimeout(watchdog);
    if (closed || !rate.enabled) return;
    watchdog = setTimeout(() => { decide(rate.checkStarvation(now())); arm(); }, rate.intervalMs);
  }

  function decide(decision) {
    if (!decision || closed) return;
    const old = channel;
    channel = rateChannel(base, rate.intervalMs, options.defaultMs);
    target.dispatchEvent(new CustomEvent("cadence", { detail: { intervalMs: rate.intervalMs, decision, channel } }));
    arm();
    switching = switching.then(async () => {
      await client.subscribe(channel, handlerFor(channel), { onError: report }); // make…
      if (old !== channel) await client.unsubscribe(old, handlerFor(old)); // …before break
    }).catch(report);
  }

  const report = options.onError || ((err) => console.error(`subscribe ${base} refused`, err));
  client.subscribe(channel, handlerFor(channel), { onError: report }).catch(report);
  arm();
  return Object.assign(target, {
    rate,
    get intervalMs() { return rate.intervalMs; },
    get channel() { return channel; },
    /** Switch adaptation on or off; off returns to the desired cadence. */
    setEnabled(enabled) {
      rate.enabled = enabled;
      if (!enabled) {
        while (rate.intervalMs > rate.desiredMs) rate._index -= 1;
        rate.reset(now());
        const old = channel;
        channel = rateChannel(base, rate.intervalMs, options.defaultMs);
        if (old !== channel) {
          switching = switching.then(async () => {
            await client.subscribe(channel, handlerFor(channel), { onError: report });
            await client.unsubscribe(old, handlerFor(old));
          }).catch(report);
        }
      }
      arm();
    },
    /** Stop following the family. */
    async close() {
      closed = true;
      clearTimeout(watchdog);
      await switching;
      await client.unsubscribe(channel, handlerFor(channel));
    },
  });
}
