// The browser module's EventCursor against the vectors the Python twin passes too.
// Run: node --test tests/js/
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { EventCursor, MAX_HELD } from "../../realtime_app/static/realtime_app/realtime.js";

const { cases } = JSON.parse(readFileSync(new URL("../vectors/cursor.json", import.meta.url)));
const shown = (actions) => actions.map(([kind, value]) => [kind, kind === "deliver" ? value.seq : value]);

for (const c of cases) {
  test(c.name, () => {
    const cursor = new EventCursor();
    for (const step of c.steps) {
      let actions = [];
      if (step.op === "message") {
        const params = { channel: "c", data: null, seq: step.seq, ts: 0 };
        if ("epoch" in step) params.epoch = step.epoch;
        actions = cursor.message(params);
      } else if (step.op === "answer") actions = cursor.answer(step.result);
      else if (step.op === "closed") cursor.closed();
      else cursor.resuming();
      assert.deepEqual(shown(actions), step.expect, JSON.stringify(step));
    }
    assert.deepEqual(cursor.since(), c.since_after);
  });
}

test("holding is bounded, then resyncs", () => {
  const cursor = new EventCursor();
  cursor.answer({ epoch: "a", seq: 0 });
  assert.deepEqual(shown(cursor.message({ epoch: "a", seq: 2 })), [["recover", { seq: 0, epoch: "a" }]]);
  for (let seq = 3; seq < MAX_HELD + 2; seq++) assert.deepEqual(cursor.message({ epoch: "a", seq }), []);
  assert.deepEqual(shown(cursor.message({ epoch: "a", seq: MAX_HELD + 2 })),
    [["resync", { epoch: "a", seq: MAX_HELD + 2, reason: "too_many_held" }]]);
  assert.deepEqual(shown(cursor.message({ epoch: "a", seq: MAX_HELD + 3 })), [["deliver", MAX_HELD + 3]]);
});
