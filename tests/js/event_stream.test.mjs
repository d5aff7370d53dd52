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
