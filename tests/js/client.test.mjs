// RealtimeClient against a scripted WebSocket: refused subscribes reach the application.
// Run: node --test tests/js/
import { test } from "node:test";
import assert from "node:assert/strict";
import { RealtimeClient, RpcError } from "../../realtime_app/static/realtime_app/realtime.js";

class FakeSocket {
  static instances = [];
  constructor(url) {
    this.url = url;
    this.readyState = 0;
    this.sent = [];
    FakeSocket.instances.push(this);
  }
  send(text) { this.sent.push(JSON.parse(text)); }
  close(code = 1000) { this.readyState = 3; this.onclose({ code, reason: "" }); }
  open() { this.readyState = 1; this.onopen(); }
  reply(result, error) {
    const request = this.sent.at(-1);
    this.onmessage({ data: JSON.stringify({ jsonrpc: "2.0", id: request.id, ...(error ? { error } : { result }) }) });
  }
}

const FORBIDDEN = { code: -32001, message: "Forbidden", data: { reason: "forbidden_channel", channel: "atelier:load" } };
const until = async (predicate) => { for (let i = 0; i < 200 && !predicate(); i++) await new Promise((r) => setTimeout(r, 5)); };

test("a subscribe made before connect() settles with the server's answer, and rejects when refused", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket });
  const errors = [];
  const refused = client.subscribe("atelier:load", () => {}, { onError: (e) => errors.push(e) });
  const accepted = client.subscribe("demo:clock", () => {});
  let settled = false;
  refused.then(() => { settled = true; }, () => { settled = true; });
  await new Promise((r) => setTimeout(r, 10));
  assert.equal(settled, false); // not before the server has answered
  client.connect();
  const socket = FakeSocket.instances[0];
  socket.open();
  const [first, second] = socket.sent;
  assert.deepEqual([first.method, first.params], ["subscribe", { channel: "atelier:load" }]);
  socket.onmessage({ data: JSON.stringify({ jsonrpc: "2.0", id: first.id, error: FORBIDDEN }) });
  socket.onmessage({ data: JSON.stringify({ jsonrpc: "2.0", id: second.id, result: { channel: "demo:clock", kind: "state", interval_ms: 1000 } }) });
  await assert.rejects(refused, (e) => e instanceof RpcError && e.reason === "forbidden_channel");
  assert.deepEqual(await accepted, { channel: "demo:clock", kind: "state", interval_ms: 1000 });
  assert.equal(errors.length, 1);
  client.close();
});

test("a re-subscription refused after a reconnect calls onError and dispatches subscribeerror", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  const errors = [];
  const events = [];
  client.addEventListener("subscribeerror", (e) => events.push(e.detail));
  client.connect();
  FakeSocket.instances[0].open();
  const answer = client.subscribe("atelier:load", () => {}, { onError: (e) => errors.push(e) });
  FakeSocket.instances[0].reply({ channel: "atelier:load", kind: "state", interval_ms: 1000 });
  assert.equal((await answer).channel, "atelier:load");
  FakeSocket.instances[0].close(1006); // the server went away; the client reconnects
  await until(() => FakeSocket.instances.length === 2);
  const again = FakeSocket.instances[1];
  again.open();
  assert.equal(again.sent[0].method, "subscribe");
  again.reply(null, FORBIDDEN); // e.g. the session ended meanwhile
  await until(() => errors.length === 1);
  assert.equal(errors[0].reason, "forbidden_channel");
  assert.deepEqual(events.map((d) => d.channel), ["atelier:load"]);
  client.close();
});

import { readFileSync } from "node:fs";
import { RefusedError, errorFromResponse, retryDelayMs } from "../../realtime_app/static/realtime_app/realtime.js";

const REFUSAL = JSON.parse(readFileSync(new URL("../vectors/refusal.json", import.meta.url)));

test("refusals become a RefusedError carrying reason, retryAfterMs and snapshot (shared vectors)", () => {
  for (const { error, refused } of REFUSAL.errors) {
    const err = errorFromResponse(error);
    assert.equal(err instanceof RefusedError, refused, JSON.stringify(error));
    assert.ok(err instanceof RpcError);
    assert.equal(err.reason, error.data.reason);
    if (refused) {
      assert.equal(err.retryAfterMs, error.data.retry_after_ms);
      assert.deepEqual(err.snapshot, error.data.snapshot);
    }
  }
  for (const { retry_after_ms, u, delay_ms } of REFUSAL.delays) {
    assert.equal(retryDelayMs(retry_after_ms, u), delay_ms);
    assert.ok(delay_ms >= retry_after_ms);
  }
});

test("a refused call rejects with RefusedError, and retries: n sends it again after retryAfterMs", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket });
  client.connect();
  const ws = FakeSocket.instances[0];
  ws.open();
  const limited = { code: -32005, message: "Rate limited", data: { reason: "rate_limited", retry_after_ms: 20, limit: 18 } };
  const plain = client.call("demo.echo", { text: "a" });
  ws.reply(null, limited);
  await assert.rejects(plain, (err) => err instanceof RefusedError && err.retryAfterMs === 20);
  const retried = client.call("demo.echo", { text: "b" }, { retries: 2 });
  await until(() => ws.sent.length === 2);
  const refusedAt = performance.now();
  ws.reply(null, limited);
  await until(() => ws.sent.length === 3);
  assert.ok(performance.now() - refusedAt >= 19, "sent again no sooner than retry_after_ms (20)");
  assert.deepEqual(ws.sent[2].params, { text: "b" });
  ws.reply({ text: "b" });
  assert.deepEqual(await retried, { text: "b" });
});

test("a channel with history: a skipped seq is resumed on the same socket, a reconnect resumes since the last", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  const got = [];
  const recovered = [];
  client.addEventListener("recovered", (e) => recovered.push(e.detail));
  client.connect();
  const socket = FakeSocket.instances[0];
  socket.open();
  const answer = client.subscribe("demo:events", (m) => got.push(m.data));
  socket.reply({ channel: "demo:events", kind: "event", interval_ms: null, epoch: "e1", seq: 10 });
  await answer;
  const message = (seq, epoch = "e1") => socket.onmessage({
    data: JSON.stringify({ jsonrpc: "2.0", method: "message", params: { channel: "demo:events", data: seq, seq, epoch, ts: 0 } }),
  });
  message(11);
  message(13); // 12 was dropped by the server's guard
  await until(() => socket.sent.length === 2);
  assert.deepEqual(socket.sent[1].params, { channel: "demo:events", since: { seq: 11, epoch: "e1" } });
  message(14);
  message(12); // the replay
  message(13);
  message(14);
  socket.reply({ channel: "demo:events", kind: "event", interval_ms: null, epoch: "e1", seq: 14, recovered: true, replayed: 3 });
  await until(() => recovered.length === 1);
  assert.deepEqual(got, [11, 12, 13, 14]);
  assert.deepEqual(recovered, [{ channel: "demo:events", replayed: 3 }]);
  socket.close(1013);
  await until(() => FakeSocket.instances.length === 2);
  const again = FakeSocket.instances[1];
  again.open();
  assert.deepEqual(again.sent[0].params, { channel: "demo:events", since: { seq: 14, epoch: "e1" } });
  client.close();
});

test("a channel with history whose gap cannot be filled dispatches resync", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  const resyncs = [];
  client.addEventListener("resync", (e) => resyncs.push(e.detail));
  client.connect();
  FakeSocket.instances[0].open();
  const answer = client.subscribe("demo:events", () => {});
  FakeSocket.instances[0].reply({ channel: "demo:events", kind: "event", interval_ms: null, epoch: "e1", seq: 3 });
  await answer;
  FakeSocket.instances[0].close(1006);
  await until(() => FakeSocket.instances.length === 2);
  const again = FakeSocket.instances[1];
  again.open();
  again.reply({ channel: "demo:events", kind: "event", interval_ms: null, epoch: "e2", seq: 7, recovered: false, reason: "epoch_changed" });
  await until(() => resyncs.length === 1);
  assert.deepEqual(resyncs, [{ channel: "demo:events", epoch: "e2", seq: 7, reason: "epoch_changed" }]);
  client.close();
});

test("a delta subscription rebuilds each publication, and subscribes again when a delta does not apply", async () => {
  const { createDelta } = await import("../../realtime_app/static/realtime_app/vendor/fossil-delta.js");
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket });
  const got = [];
  client.connect();
  const socket = FakeSocket.instances[0];
  socket.open();
  const answer = client.subscribe("dash", (params) => got.push(params), { delta: "fossil" });
  assert.deepEqual(socket.sent.at(-1).params, { channel: "dash", delta: "fossil" });
  socket.reply({ channel: "dash", kind: "state", interval_ms: null, delta: "fossil" });
  await answer;
  const states = [{ a: 1, label: "état ✓" }, { a: 2, label: "état ✓" }, { a: 3, label: "état ✓✓" }];
  const texts = states.map((s) => JSON.stringify(s));
  const frame = (seq, data, delta) => socket.onmessage({ data: JSON.stringify(
    { jsonrpc: "2.0", method: "message", params: { channel: "dash", data, delta, seq, ts: 0 } }) });
  const latin1 = (bytes) => String.fromCharCode(...bytes);
  frame(1, texts[0], false);
  for (const i of [1, 2]) frame(i + 1, latin1(createDelta(new TextEncoder().encode(texts[i - 1]), new TextEncoder().encode(texts[i]))), true);
  assert.deepEqual(got.map((p) => p.data), states);
  const before = socket.sent.length;
  const other = new TextEncoder().encode(JSON.stringify({ a: 9, label: "ETAT !!", pad: "x".repeat(40) }));
  frame(4, latin1(createDelta(other, new TextEncoder().encode(JSON.stringify({ a: 9, label: "ETAT !!", pad: "y" })))), true);
  assert.equal(got.length, 3); // never applied
  assert.deepEqual(socket.sent.at(-1).params, { channel: "dash", delta: "fossil" }); // subscribed again
  assert.equal(socket.sent.length, before + 1);
  client.close();
});

test("unsubscribing a cadence the server moved leaves the channel the server subscribed", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket });
  client.connect();
  const socket = FakeSocket.instances[0];
  socket.open();
  const handler = () => {};
  const answer = client.subscribe("demo:clock:700", handler);
  socket.reply({ channel: "demo:clock:300", kind: "state", interval_ms: 300 }); // past the cadence cap
  assert.equal((await answer).channel, "demo:clock:300");
  const leaving = client.unsubscribe("demo:clock:700", handler);
  await until(() => socket.sent.at(-1).method === "unsubscribe");
  assert.deepEqual(socket.sent.at(-1).params, { channel: "demo:clock:300" });
  socket.reply({ channel: "demo:clock:300", unsubscribed: true });
  await leaving;
  client.close();
});

import { OutcomeUnknownError } from "../../realtime_app/static/realtime_app/realtime.js";

test("an idempotent call lost with its connection is sent again with the same key; any other call is not", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  client.connect();
  FakeSocket.instances[0].open();
  const bid = client.call("demo.bid", { lot: 7, amount: 120 }, { idempotent: true });
  const other = client.call("demo.bid", { lot: 7, amount: 130 });
  await until(() => FakeSocket.instances[0].sent.length === 2);
  const [first] = FakeSocket.instances[0].sent;
  assert.match(first.params.idempotency_key, /^[0-9a-f]{32}$/);
  FakeSocket.instances[0].close(1006); // lost before either answer
  await assert.rejects(other, (e) => e instanceof OutcomeUnknownError);
  await until(() => FakeSocket.instances.length === 2);
  const again = FakeSocket.instances[1];
  again.open();
  await until(() => again.sent.some((r) => r.method === "demo.bid"));
  const resent = again.sent.find((r) => r.method === "demo.bid");
  assert.deepEqual(resent.params, first.params); // the same key: the server runs it once
  again.onmessage({ data: JSON.stringify({ jsonrpc: "2.0", id: resent.id, result: { lot: 7, price: 120, bids: 1 } }) });
  assert.deepEqual(await bid, { lot: 7, price: 120, bids: 1 });
  await assert.rejects(client.call("demo.bid", [7, 120], { idempotent: true }), TypeError);
  client.close();
});

test("a token signs every connection in with auth, its first request, and is refreshed when it expires", async () => {
  FakeSocket.instances = [];
  let issued = 0;
  const client = new RealtimeClient({
    url: "ws://x/realtime/", WebSocket: FakeSocket, token: "t0", refreshToken: async () => `t${++issued}`,
  });
  client.subscribe("room:a", () => {}).catch(() => {}); // never answered here
  client.connect();
  const socket = FakeSocket.instances[0];
  socket.open();
  assert.deepEqual(socket.sent.map((r) => r.method), ["auth", "subscribe"]);
  assert.deepEqual(socket.sent[0].params, { token: "t0" });
  socket.onmessage({ data: JSON.stringify({ jsonrpc: "2.0", method: "token_expiring", params: { expires_at: 1 } }) });
  await until(() => socket.sent.length === 3);
  assert.deepEqual([socket.sent[2].method, socket.sent[2].params], ["auth", { token: "t1" }]);
  assert.equal(client.token, "t1"); // the next connection signs in with the new one
  client.close();
});

test("presence frames keep the member set, also the reset sent before the subscribe's answer", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket });
  const seen = [];
  client.addEventListener("presence", (e) => seen.push(e.detail));
  client.connect();
  const socket = FakeSocket.instances[0];
  socket.open();
  const answer = client.subscribe("lot:0042", () => {}, { presence: true });
  assert.deepEqual(socket.sent[0].params, { channel: "lot:0042", presence: true });
  const frame = (params) => socket.onmessage({ data: JSON.stringify({ jsonrpc: "2.0", method: "presence", params }) });
  frame({ channel: "lot:42", count: 1, anonymous: 0, joined: [], left: [], updated: [], reset: true, members: [{ user: "ann", connections: 1 }] });
  socket.reply({ channel: "lot:42", kind: "event", interval_ms: null, presence: true });
  await answer;
  frame({ channel: "lot:42", count: 2, anonymous: 0, joined: [{ user: "bob", connections: 1 }], left: [], updated: [] });
  assert.deepEqual([...client.members("lot:0042").keys()], ["ann", "bob"]);
  assert.equal(seen.length, 2);
  socket.close(1006); // members are known again from the next reset
  assert.equal(client.members("lot:0042").size, 0);
  client.close();
});

test("a connection closed because its token expired connects again with a new one", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, token: "old", refreshToken: async () => "new" });
  client.connect();
  FakeSocket.instances[0].open();
  FakeSocket.instances[0].close(4004);
  await until(() => FakeSocket.instances.length === 2);
  FakeSocket.instances[1].open();
  assert.deepEqual(FakeSocket.instances[1].sent[0].params, { token: "new" });
  const fatal = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, token: "old" });
  fatal.connect();
  FakeSocket.instances[2].open();
  FakeSocket.instances[2].close(4004); // no way to get a new one: final
  assert.equal(fatal.state, "closed");
  client.close();
});

test("a close that says retry_after_ms waits that long before the next connection", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  const delays = [];
  const realSetTimeout = globalThis.setTimeout;
  globalThis.setTimeout = (fn, ms) => { delays.push(ms); return realSetTimeout(fn, 0); };
  try {
    client.connect();
    FakeSocket.instances[0].open();
    FakeSocket.instances[0].readyState = 3;
    FakeSocket.instances[0].onclose({ code: 1012, reason: "retry_after_ms=1234" });
    assert.equal(delays.at(-1), 1234);
  } finally {
    globalThis.setTimeout = realSetTimeout;
    client.close();
  }
});

test("a drain's reconnect ticket is shown on the next handshakes until one is served, then no more", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/?v=2", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  client.connect();
  FakeSocket.instances[0].open();
  FakeSocket.instances[0].readyState = 3;
  FakeSocket.instances[0].onclose({ code: 1012, reason: "retry_after_ms=1 ticket=n0nce:1x:S1g-_" });
  await until(() => FakeSocket.instances.length === 2);
  assert.equal(FakeSocket.instances[1].url, "ws://x/realtime/?v=2&ticket=n0nce%3A1x%3AS1g-_");
  FakeSocket.instances[1].onclose({ code: 1006, reason: "" }); // the next process not listening yet: kept
  await until(() => FakeSocket.instances.length === 3);
  assert.equal(FakeSocket.instances[2].url, "ws://x/realtime/?v=2&ticket=n0nce%3A1x%3AS1g-_");
  FakeSocket.instances[2].open(); // accepted, then closed: a refusal (too many handshakes) is no entry
  FakeSocket.instances[2].close(1013);
  await until(() => FakeSocket.instances.length === 4);
  assert.equal(FakeSocket.instances[3].url, "ws://x/realtime/?v=2&ticket=n0nce%3A1x%3AS1g-_");
  FakeSocket.instances[3].open();
  FakeSocket.instances[3].onmessage({ data: JSON.stringify({ jsonrpc: "2.0", method: "ping" }) }); // served: spent
  FakeSocket.instances[3].close(1013);
  await until(() => FakeSocket.instances.length === 5);
  assert.equal(FakeSocket.instances[4].url, "ws://x/realtime/?v=2");
  client.close();
});

test("a re-subscription refused for now after a reconnect (too many resumes) is sent again after retryAfterMs", async () => {
  FakeSocket.instances = [];
  const client = new RealtimeClient({ url: "ws://x/realtime/", WebSocket: FakeSocket, backoffInitialMs: 1, backoffMaxMs: 2 });
  const errors = [];
  client.connect();
  FakeSocket.instances[0].open();
  const answer = client.subscribe("demo:events", () => {}, { onError: (e) => errors.push(e) });
  FakeSocket.instances[0].reply({ channel: "demo:events", kind: "event", interval_ms: 0 });
  await answer;
  FakeSocket.instances[0].close(1012); // a deploy: every client comes back at once
  await until(() => FakeSocket.instances.length === 2);
  const again = FakeSocket.instances[1];
  again.open();
  const tooMany = { code: -32003, message: "Too many resumes", data: { reason: "too_many_resumes", retry_after_ms: 20 } };
  again.reply(null, tooMany);
  await until(() => again.sent.length === 2); // sent again, on the same connection
  assert.deepEqual([again.sent[1].method, again.sent[1].params.channel], ["subscribe", "demo:events"]);
  again.reply({ channel: "demo:events", kind: "event", interval_ms: 0 });
  await until(() => client._answers.get("demo:events") !== undefined && errors.length === 1);
  assert.equal(errors[0].reason, "too_many_resumes"); // the application heard of the refusal all the same
  assert.equal(again.sent.length, 2);
  client.close();
});
