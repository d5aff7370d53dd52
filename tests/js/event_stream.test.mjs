// The browser module's event-stream reader against the vectors the Python twin passes too.
// Run: node --test tests/js/
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { EventParser, translateEvent } from "../../realtime_app/static/realtime_app/realtime.js";

const { cases } = JSON.parse(readFileSync(new URL("../vectors/event_stream.json", import.meta.url)));

for (const c of cases) {
  test(c.name, () => {
    const parser = new EventParser();
    const events = c.chunks.flatMap((chunk) => parser.feed(chunk));
    assert.deepEqual(events, c.events);
    assert.deepEqual(events.map(translateEvent), c.translated);
    assert.equal(parser.retryMs, c.retry_ms ?? null);
  });
}

test("subscribes sent together open one stream", async () => {
  const { SseSocket } = await import("../../realtime_app/static/realtime_app/realtime.js");
  const streams = [];
  const fetch = async (url) => {
    if (url.includes("/rpc")) return new Response(null, { status: 204 });
    streams.push(url);
    return new Response(new ReadableStream({ start() {} }), { status: 200 });
  };
  const socket = new SseSocket("ws://127.0.0.1:1/realtime/", { fetch });
  await new Promise((resolve) => { socket.onopen = resolve; });
  for (const [id, channel] of [[1, "a"], [2, "b"], [3, "c"]]) {
    socket.send(JSON.stringify({ jsonrpc: "2.0", method: "subscribe", params: { channel }, id }));
  }
  await new Promise((resolve) => setTimeout(resolve, 100));
  assert.deepEqual(streams, ["http://127.0.0.1:1/realtime/sse?channel=a&channel=b&channel=c"]);
  socket.close();
});
