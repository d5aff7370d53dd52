// The admin screen's chart scale (realtime_app/static/realtime_app/admin_charts.js): round
// tops, and a spike that does not flatten the rest.
import { test } from "node:test";
import assert from "node:assert/strict";
import { formatBytes, niceCeil, scaleTop } from "../../realtime_app/static/realtime_app/admin_charts.js";

test("tops are round 1-2-5 values at or above what they hold", () => {
  assert.deepEqual([0.3, 1, 1.2, 3, 7, 11, 4500].map(niceCeil), [0.5, 1, 2, 5, 10, 20, 5000]);
  assert.equal(niceCeil(0), 1);
});

test("the scale follows what is usual, not one spike", () => {
  const usual = Array.from({ length: 50 }, (_, i) => 10 + (i % 5));
  assert.equal(scaleTop([...usual, 100000]), 20); // the spike is drawn clipped, marked
  assert.equal(scaleTop([], 1000), 1000); // an empty chart keeps its floor
  assert.equal(scaleTop([0, 0, 0], 10), 10);
});

test("bytes read as people read them", () => {
  assert.deepEqual([0, 512, 2048, 5 * 1024 * 1024].map(formatBytes), ["0 B", "512 B", "2.0 KiB", "5.0 MiB"]);
});
