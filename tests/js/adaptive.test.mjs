// The browser module's AdaptiveRate against the vectors the Python twin passes too.
// Run: node --test tests/js/
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { AdaptiveRate, deriveLadder, rateChannel, isReconnectableCloseCode } from "../../realtime_app/static/realtime_app/realtime.js";

const { cases } = JSON.parse(readFileSync(new URL("../vectors/adaptive.json", import.meta.url)));
const camel = (s) => s.replace(/_([a-z])/g, (_, c) => c.toUpperCase());

for (const c of cases) {
  test(c.name, () => {
    const options = Object.fromEntries(Object.entries(c.options || {}).map(([k, v]) => [camel(k), v]));
    const rate = new AdaptiveRate(c.interval_ms, options);
    if (c.ladder) assert.deepEqual(rate.ladder, c.ladder);
    for (const step of c.steps) {
      const decision = step.op === "frame" ? rate.noteFrame(step.t) : rate.checkStarvation(step.t);
      assert.deepEqual([decision, rate.intervalMs], [step.decision, step.interval_ms], JSON.stringify(step));
    }
    if ("healthy_count_after" in c) assert.equal(rate.healthyCount, c.healthy_count_after);
  });
}

test("deriveLadder", () => {
  assert.deepEqual(deriveLadder(1000), [1000, 2000, 4000, 8000, 16000, 32000, 60000]);
  assert.deepEqual(deriveLadder(250, 1000), [250, 500, 1000]);
  assert.throws(() => deriveLadder(0), RangeError);
});

test("rateChannel names the default by its base", () => {
  assert.equal(rateChannel("atelier:load", 1000, 1000), "atelier:load");
  assert.equal(rateChannel("atelier:load", 2000, 1000), "atelier:load:2000");
  assert.equal(rateChannel("atelier:load", 2000), "atelier:load:2000");
  assert.throws(() => rateChannel("a", 0, 1000), RangeError);
  assert.throws(() => rateChannel("a", 1.5, 1000), RangeError);
});

test("close codes: transient ones reconnect, 1008 and 4xxx do not", () => {
  for (const code of [1001, 1005, 1006, 1011, 1012, 1013]) assert.equal(isReconnectableCloseCode(code), true, code);
  for (const code of [1000, 1003, 1007, 1008, 1009, 4001, 4403]) assert.equal(isReconnectableCloseCode(code), false, code);
});
